"""The critic's loss: a squared error to the returns, its step bounded like PPO's ratio (value clipping).

``L_t = ½ · max((V_t − R_t)², (clip(V_t, V_old,t − ε, V_old,t + ε) − R_t)²)``

with ``V`` the value being trained, ``V_old`` the value the advantages were computed with (before this update),
``R`` the GAE returns and ``ε`` = ``cliprange_value`` (veRL's ``compute_value_loss`` and its name; OpenAI
baselines' ``ppo2`` value clipping). The max makes the clip pessimistic: a prediction that moved more than ε
away from ``V_old`` toward the target gets no further gradient, one that moved away from it is still pulled back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ValueLossOutput:
    token_loss: torch.Tensor  # [B, R]: L_t above
    clipped: torch.Tensor  # [B, R] float: 1 where the clipped term was the larger (no gradient through V_t)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       *, cliprange_value: float | None = None) -> ValueLossOutput:
    """``L_t`` of the module docstring on every token (0 where ``mask`` is 0); ``cliprange_value`` None: no clip,
    ``½(V − R)²``."""
    m = mask.to(torch.float32)
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        return ValueLossOutput(0.5 * unclipped * m, torch.zeros_like(m))
    bounded = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    clipped = (bounded - returns) ** 2
    return ValueLossOutput(0.5 * torch.maximum(unclipped, clipped) * m, (clipped > unclipped).to(m.dtype) * m)
