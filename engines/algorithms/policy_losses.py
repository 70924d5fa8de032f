"""Policy losses, per token. The trainer multiplies the result by importance weights, then aggregates it
(:mod:`.aggregation`); keeping those three steps apart keeps each one a few lines.

Common signature::

    fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, **params) -> PolicyLossOutput

all ``[B, R]``: ``logprobs`` of the current policy (with gradient), ``old_logprobs`` of the policy that the ratio
is taken against (no gradient), per-token ``advantages`` and the trained-token ``mask``. ``params`` are the
loss's own keywords (``trainer.algorithm.policy_loss_params``; ``clip_ratio_c`` for the losses that take it).

Besides the PPO family and the SFT terms here: :mod:`.cispo`, :mod:`.sapo`, :mod:`.topr`, :mod:`.opmd`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


# exp() of a log-ratio above this overflows float32 usefulness long before it overflows the type
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class PolicyLossOutput:
    token_loss: torch.Tensor  # [B, R], to be weighted, masked and aggregated
    ratio: torch.Tensor  # [B, R] importance ratio the loss used (detached)
    clipped: torch.Tensor  # [B, R] bool: the clipped branch was active (no gradient from that token)
    # the loss's own shares, reported as ``actor/<name>``: a [B, R] tensor is averaged over the trained tokens,
    # a [B] one over the sequences (e.g. ``cispo_clip_frac``: the share of tokens whose weight was clipped)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric bounds (DAPO "clip-higher" when ``clip_high > clip_low``):

    ``ρ_t = exp(logp_t − logp_old_t)``,
    ``L_t = −min(ρ_t·A_t, clip(ρ_t, 1 − clip_low, 1 + clip_high)·A_t)``.

    A token counts as clipped when the clipped branch is the smaller one and differs, i.e.
    ``A>0 and ρ>1+clip_high`` or ``A<0 and ρ<1−clip_low``.

    **Dual-clip** (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", Eq. 5), with
    ``clip_ratio_c = c > 1``: for ``A_t < 0`` the objective is also bounded below by ``c·A_t``,
    ``L_t = min(−min(ρ_t·A_t, clip(ρ_t, …)·A_t), −c·A_t)``, so a token the policy already made far more
    likely (``ρ_t > c``) than the sampler did cannot push an unbounded negative step; such a token is clipped
    (no gradient) and counted in ``pg_clipfrac_lower`` (veRL's name).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    out = _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high)
    if clip_ratio_c is None:
        return out
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (the lower bound c·A of a negative advantage), got {clip_ratio_c}")
    bound = -clip_ratio_c * advantages
    lower = (advantages < 0) & (out.token_loss > bound) & (mask > 0)
    token_loss = torch.where(advantages < 0, torch.minimum(out.token_loss, bound), out.token_loss)
    return PolicyLossOutput(token_loss, out.ratio, out.clipped | lower, {"pg_clipfrac_lower": lower})


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float,
                       clip_high: float) -> PolicyLossOutput:
    """``L = −min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A)`` per token, shared by the token- and
    sequence-ratio losses; a token is clipped where the clipped branch is the smaller one and differs."""
    unclipped = ratio * advantages
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped_obj)
    clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    return PolicyLossOutput(token_loss, ratio.detach(), clipped & (mask > 0))


def decoupled_ppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> PolicyLossOutput:
    """Decoupled PPO (AReaL, Fu et al. 2025) for rollouts several versions old: the clip is taken against the
    *proximal* policy — the trainer's weights at train time — and the behaviour policy only reweights:

    ``L_t = −w_t · min(r_t·A_t, clip(r_t, 1 − clip_low, 1 + clip_high)·A_t)``,
    ``r_t = π_θ / π_prox``, ``w_t = min(π_prox / π_behav, tis_cap)`` (no gradient).

    Here ``old_logprobs`` are the proximal logprobs: with this loss the training engine always recomputes them
    under the current weights before the step (``recompute_old_logprobs`` must stay true) and puts ``w_t`` on
    every row as the loss weights (as ``tis: true`` does), so this function is the clipped surrogate of ``r_t``;
    the trust region is around the current weights however stale the sample, which is what lets a
    ``fully_async`` window grow without the loss of accuracy plain PPO shows. ``clip_ratio_c``: dual-clip, as in
    :func:`ppo_clip`.
    """
    return ppo_clip(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                    clip_ratio_c=clip_ratio_c)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of its token ratios.

    ``s_i = exp((1/|y_i|) Σ_t m_it (logp_it − logp_old_it))``; in the token form used here
    ``s_it = sg(s_i) · exp(logp_it − sg(logp_it))`` (same value, and its gradient is that of ``s_i`` spread evenly
    over the sequence's tokens), ``L_it = −min(s_it·A_it, clip(s_it, 1 − clip_low, 1 + clip_high)·A_it)``.
    The paper's clip ranges are tiny (3e-4 / 4e-4) because ``s_i`` is a per-token geometric mean. Pair with the
    ``seq-mean-token-mean`` aggregation to get the paper's sequence-level objective exactly.
    """
    m = mask.to(logprobs.dtype)
    seq_log_ratio = ((logprobs - old_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1)
    seq_log_ratio = seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio)
    return _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high)


def sft(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
) -> PolicyLossOutput:
    """Supervised fine-tuning on the responses: ``L_t = −logp_t`` (negative log-likelihood).

    Ignores ``old_logprobs`` and ``advantages``; the reported ratio is 1 and nothing is clipped.
    """
    ones = torch.ones_like(logprobs).detach()
    return PolicyLossOutput(-logprobs, ones, torch.zeros_like(mask, dtype=torch.bool))


def sft_phi(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.0,
    clip_high: float = 0.0,
) -> PolicyLossOutput:
    """CHORD-φ's SFT term (Zhang et al. 2025, arXiv:2508.11408, the φ-weighted SFT loss):
    ``L_t = −sg(φ(p_t)) · log p_t`` with ``p_t = exp(logp_t)`` and ``φ(p) = p·(1 − p)``: tokens the policy
    already finds near-certain (``p → 1``) or near-impossible (``p → 0``) barely move it, so
    the expert data teaches without overwriting what RL learnt. Ignores ``old_logprobs`` and ``advantages``;
    ``sft_phi_weight_mean`` reports the mean ``φ``."""
    p = logprobs.detach().exp()
    phi = p * (1.0 - p)
    ones = torch.ones_like(logprobs).detach()
    return PolicyLossOutput(-phi * logprobs, ones, torch.zeros_like(mask, dtype=torch.bool),
                            {"sft_phi_weight_mean": phi})
