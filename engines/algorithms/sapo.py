"""SAPO: a soft, sign-dependent gate instead of PPO's hard clip (Gao et al. 2025, "Soft Adaptive Policy
Optimization", arXiv:2511.20347)."""
from __future__ import annotations

import torch

from .policy_losses import MAX_LOG_RATIO, PolicyLossOutput


def sapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLossOutput:
    """The SAPO objective, per token (the paper's ``J(θ) = E[1/G Σ_i 1/|y_i| Σ_t f_it(r_it(θ))·Â_it]``):

    ``r_t = π_θ / π_old``, ``τ_t = tau_pos if A_t > 0 else tau_neg``,
    ``f(r) = σ(τ·(r − 1)) · 4/τ``, ``L_t = −f(r_t)·A_t``.

    Its gradient is ``−w_t · r_t · A_t · ∇log π_θ`` with the gate ``w_t = 4·p_t·(1 − p_t)``,
    ``p_t = σ(τ_t·(r_t − 1))``: 1 on-policy (``r = 1``), decaying smoothly as the ratio leaves 1, faster for
    a larger τ (``tau_neg > tau_pos``: negative advantages are damped harder, the paper's stabiliser). This is the
    paper's objective differentiated as written (veRL's form); Trinity-RFT's ``sapo`` instead weights
    ``log π`` by the detached ``f(r)`` (a gradient ``f(r)·A``, ``2/τ`` on-policy). ``clip_low``/``clip_high`` are
    unused (no hard clip: no token is clipped); ``sapo_gate_mean`` reports the mean gate ``w_t``. The paper
    pairs it with ``seq-mean-token-mean`` aggregation.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0 (gate temperatures), got {tau_pos}, {tau_neg}")
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    token_loss = -gate * (4.0 / tau) * advantages
    p = gate.detach()
    no_clip = torch.zeros_like(mask, dtype=torch.bool)
    return PolicyLossOutput(token_loss, ratio.detach(), no_clip, {"sapo_gate_mean": 4.0 * p * (1.0 - p)})
