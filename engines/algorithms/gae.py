"""Generalized advantage estimation over the response tokens, with a learned value function (PPO with a critic).

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16:

    ``Â_t = Σ_{l ≥ 0} (γλ)^l δ_{t+l}``,  ``δ_t = r_t + γ·V(s_{t+1}) − V(s_t)``  (eq. 10 defines δ),

computed backwards as ``Â_t = δ_t + γλ·Â_{t+1}``. Per response token ``t`` of a sample: ``V(s_t)`` is the critic's
value of the text before token ``t``, ``r_t`` the token rewards (a KL penalty, a record's dense rewards) plus the
outcome reward on the sample's last trained token, and the value after the last token is 0 (the episode ends).
Untrained tokens (``mask`` 0: an environment's turn) are skipped: they neither add reward nor discount, and the
next trained token's value stands in for ``V(s_{t+1})``. The critic's targets are the λ-returns
``R_t = Â_t + V(s_t)`` (before whitening); veRL's ``compute_gae_advantage_return`` computes the same.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .advantages import last_token_mask

WHITEN_EPS = 1e-8


def step_rewards(rewards: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None) -> torch.Tensor:
    """``r_t`` of every trained token ``[B, R]``: ``token_rewards`` plus the outcome ``rewards`` on the last one."""
    m = mask.to(torch.float32)
    r = last_token_mask(m) * rewards.to(torch.float32)[:, None]
    if token_rewards is not None:
        r = r + token_rewards.to(torch.float32) * m
    return r


def gae_advantages_and_returns(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                               gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Â, R = Â + V)``, both ``[B, R]`` and 0 where ``mask`` is 0, from the per-token rewards ``r_t`` and values
    ``V(s_t)`` (module docstring: eq. 16 of the GAE paper, untrained tokens skipped)."""
    m = mask.to(torch.float32)
    r, v = token_rewards.to(torch.float32), values.to(torch.float32)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    running = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        trained = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(trained, delta + gamma * lam * running, running)
        next_value = torch.where(trained, v[:, t], next_value)
        advantages[:, t] = running
    return advantages * m, (advantages + v) * m


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x − mean) / sqrt(var + 1e-8)`` over the trained tokens (unbiased variance, as veRL's ``masked_whiten``);
    0 elsewhere, and all 0 when fewer than two tokens are trained."""
    m = mask.to(torch.float32)
    count = m.sum()
    if count < 2:
        return torch.zeros_like(values)
    mean = (values * m).sum() / count
    var = (((values - mean) * m) ** 2).sum() / (count - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS) * m


def gae(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> torch.Tensor:
    """GAE (Schulman et al. 2016, eq. 16; module docstring) with the critic's ``values`` ``[B, R]``, whitened over
    the batch's trained tokens (``whiten``, as veRL and Trinity-RFT do). ``gamma``, ``lam``: the run's
    ``trainer.algorithm.gae_gamma`` / ``gae_lambda``. No group baseline: the critic is the baseline, so
    ``group_ids`` are not used and ``repeat_times`` may be 1."""
    advantages, _ = gae_advantages_and_returns(step_rewards(rewards, mask, token_rewards), values, mask,
                                               gamma=gamma, lam=lam)
    return masked_whiten(advantages, mask) if whiten else advantages


def gae_returns(rewards: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None,
                values: torch.Tensor, *, gamma: float, lam: float) -> torch.Tensor:
    """The critic's targets ``R_t = Â_t + V(s_t)`` ``[B, R]`` (before any whitening of ``Â``)."""
    _, returns = gae_advantages_and_returns(step_rewards(rewards, mask, token_rewards), values, mask,
                                            gamma=gamma, lam=lam)
    return returns
