"""Truncated importance sampling between the behaviour policy (the rollout engine that sampled the tokens,
possibly several versions ago) and the policy the trainer takes its PPO ratio against.

Rollout engines (vLLM, a stale worker, bf16 kernels) do not produce exactly the trainer's probabilities, so the
samples are slightly off-policy. Truncated IS (Ionides 2008; Yao et al. 2025 for LLM RL) reweights each token's
loss by ``w_t = min(exp(logp_old_t − logp_behaviour_t), cap)``: unbiased where the ratio is below the cap,
bounded variance above it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class ImportanceWeights:
    weights: torch.Tensor  # [B, R] weight per token (1 on untouched rows, 0 where mask is 0)
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    truncated_fraction: float  # of the corrected trained tokens

    def metrics(self, prefix: str = "actor/is_") -> dict[str, float]:
        return {
            f"{prefix}ratio_mean": self.ratio_mean,
            f"{prefix}ratio_min": self.ratio_min,
            f"{prefix}ratio_max": self.ratio_max,
            f"{prefix}truncated_frac": self.truncated_fraction,
        }


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    rows: torch.Tensor | None = None,
) -> ImportanceWeights:
    """``w_t = min(exp(logp_old_t − logp_behaviour_t), cap)`` on trained tokens of the selected ``rows``
    (bool ``[B]``; all rows when None); weight 1 elsewhere. Statistics are over the corrected tokens, before
    truncation."""
    m = mask > 0
    if rows is not None:
        m = m & rows[:, None]
    ratio = torch.exp((old_logprobs - behaviour_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()
    weights = torch.where(m, ratio.clamp(max=cap), torch.ones_like(ratio)) * (mask > 0)
    picked = ratio[m]
    if picked.numel() == 0:
        return ImportanceWeights(weights, 1.0, 1.0, 1.0, 0.0)
    return ImportanceWeights(
        weights,
        ratio_mean=float(picked.mean()),
        ratio_min=float(picked.min()),
        ratio_max=float(picked.max()),
        truncated_fraction=float((picked > cap).float().mean()),
    )
