"""CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585,
§3.1)."""
from __future__ import annotations

import torch

from .policy_losses import MAX_LOG_RATIO, PolicyLossOutput


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> PolicyLossOutput:
    """The CISPO objective of MiniMax-M1 §3.1, per token:

    ``r_t = π_θ / π_old``, ``r̂_t = clip(r_t, 1 − clip_low, 1 + clip_high)``,
    ``L_t = −sg(r̂_t) · A_t · log π_θ(y_t)``.

    Unlike PPO, a token outside the band is not dropped: its weight is clipped and its gradient
    ``−r̂_t·A_t·∇log π_θ`` kept, so rare high-ratio tokens (the "wait", "however" of long reasoning) keep
    learning. The paper sets no lower bound (``clip_low ≥ 1``) and tunes ``clip_high``; pair it with the
    token-mean aggregation (the paper normalises by all tokens of the group). No token is clipped in PPO's
    sense (every one has a gradient); ``cispo_clip_frac`` is the share of tokens whose weight was clipped.
    """
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    weight = ratio.clamp(max(1.0 - clip_low, 0.0), 1.0 + clip_high)
    token_loss = -weight * advantages * logprobs
    clipped = (weight != ratio) & (mask > 0)
    return PolicyLossOutput(token_loss, ratio, torch.zeros_like(clipped), {"cispo_clip_frac": clipped})
