"""OPMD: online policy mirror descent as Trinity-RFT runs it (Yao et al. 2025, "Group-relative REINFORCE is
secretly an off-policy algorithm", arXiv:2509.24203, §2.2; first in the Trinity-RFT report, arXiv:2505.17826,
App. A): a group baseline, then REINFORCE scaled by ``1/(1 + τ)``. Both halves are here, one algorithm."""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from .advantages import group_index, sequence_scores
from .policy_losses import MAX_LOG_RATIO, PolicyLossOutput


def opmd_advantage(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    baseline: Literal["mean", "logavgexp"] = "mean",
    tau: float = 1.0,
) -> torch.Tensor:
    """``A_i = s_i − b_g``, with ``b_g`` the group mean (``baseline: mean``) or the KL-regularised optimum's
    ``τ · log((1/K) Σ_j exp(s_j / τ))`` (``logavgexp``: the estimate of ``τ·log Z`` of the mirror-descent step
    ``π ∝ π_old · exp(r/τ)``). No standard-deviation scaling. A singleton's baseline is 0, as in Trinity-RFT, so
    its advantage is its score."""
    if baseline not in ("mean", "logavgexp"):
        raise ValueError(f"opmd baseline must be mean or logavgexp, got {baseline!r}")
    if tau <= 0:
        raise ValueError(f"opmd tau must be > 0, got {tau}")
    scores = sequence_scores(rewards, mask, token_rewards)
    index, n_groups = group_index(group_ids, scores.device)
    count = torch.zeros(n_groups, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    if baseline == "mean":
        base = torch.zeros(n_groups, device=scores.device).index_add_(0, index, scores) / count
    else:  # logsumexp per group, shifted by the group max for stability
        top = torch.full((n_groups,), -math.inf, device=scores.device).scatter_reduce(0, index, scores, "amax")
        total = torch.zeros(n_groups, device=scores.device).index_add_(0, index, torch.exp((scores - top[index]) / tau))
        base = top + tau * torch.log(total / count)
    adv = torch.where(count[index] > 1, scores - base[index], scores)
    return adv[:, None] * mask.to(torch.float32)


def opmd(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
    tau: float = 1.0,
) -> PolicyLossOutput:
    """``L_t = −A_t · log π_θ(y_t) / (1 + τ)``, Trinity-RFT's ``opmd`` policy loss: the REINFORCE step of the
    mirror-descent update ``π ∝ π_old · exp(r/τ)`` with ``A`` from :func:`opmd_advantage` (rewards minus
    ``τ·log Z``), scaled by ``1/(1 + τ)``, the step size of the update regularised toward the current policy.
    ``old_logprobs`` and the clip bounds are unused (nothing clipped); pair it with ``advantage: opmd`` and the
    same ``tau`` in ``advantage_params`` and ``policy_loss_params``."""
    if tau < 0:
        raise ValueError(f"opmd tau must be >= 0, got {tau}")
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return PolicyLossOutput(-advantages * logprobs / (1.0 + tau), ratio, torch.zeros_like(mask, dtype=torch.bool))
