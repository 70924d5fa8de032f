"""TOPR: tapered off-policy REINFORCE (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", arXiv:2503.14286)."""
from __future__ import annotations

import torch

from .policy_losses import MAX_LOG_RATIO, PolicyLossOutput


def topr(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
    threshold: float = 0.0,
) -> PolicyLossOutput:
    """TOPR's gradient (the paper's Eq. for ``∇J_TOPR``):

    ``∇J = Σ_{R(y) ≥ 0} R(y)·∇log π(y) + Σ_{R(y) < 0} [π(y)/μ(y)]_0^1 · R(y)·∇log π(y)``

    over sequences ``y`` sampled by ``μ``: positive examples are trained like SFT, with no importance weight;
    negative ones are tapered by their sequence ratio truncated at 1, so pushing down a sequence the policy has
    already made unlikely stops. Per token: ``ρ_i = exp(Σ_t m_it (logp_it − logp_old_it))``,
    ``α_i = min(ρ_i, 1)`` if ``A_i < threshold`` else 1, ``L_it = −sg(α_i) · A_it · logp_it``.

    The paper uses the reward as ``A`` (any advantage is accepted, the baseline trick); μ is ``old_logprobs``:
    with ``recompute_old_logprobs: false`` the sampler's, as in the paper. Trinity-RFT's ``topr`` tapers each
    token by its own ratio; this is the paper's sequence ratio. ``topr_tapered_frac``: share of sequences whose
    weight was below 1.
    """
    m = mask.to(logprobs.dtype)
    seq_log_ratio = (((logprobs - old_logprobs).detach() * m).sum(-1)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_ratio = torch.exp(seq_log_ratio)
    seq_advantage = (advantages * m).sum(-1) / m.sum(-1).clamp(min=1)  # the sequence's (its tokens share it)
    negative = seq_advantage < threshold
    alpha = torch.where(negative, seq_ratio.clamp(max=1.0), torch.ones_like(seq_ratio))
    token_loss = -alpha[:, None] * advantages * logprobs
    tapered = negative & (seq_ratio < 1.0) & (mask > 0).any(-1)
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return PolicyLossOutput(token_loss, ratio, torch.zeros_like(mask, dtype=torch.bool),
                            {"topr_tapered_frac": tapered})
