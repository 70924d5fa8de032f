"""KL estimators between the policy ``π`` (whose samples these are) and a reference policy ``π_ref``.

Common signature: ``fn(logprobs [B, R], ref_logprobs [B, R]) -> [B, R]``, an estimate of ``KL(π‖π_ref)`` per
token (Schulman, "Approximating KL divergence", 2020). With ``log r = logp_ref − logp``:

* ``k1 = −log r`` — unbiased, high variance, can be negative;
* ``k2 = ½ (log r)²`` — biased, low variance, always ≥ 0;
* ``k3 = (r − 1) − log r`` — unbiased, low variance, always ≥ 0 (GRPO's choice).

Use them as a loss term (trainer ``kl_coef``) or as a reward penalty (:func:`kl_penalty`). The log-ratio is
clamped to ±20 before ``exp`` so a token the reference finds impossible cannot produce inf.
"""
from __future__ import annotations

import torch

from .catalog import KL_ESTIMATORS


MAX_LOG_RATIO = 20.0


def _log_r(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = logp − logp_ref``."""
    return -_log_r(logprobs, ref_logprobs)


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = ½ (logp_ref − logp)²``."""
    return 0.5 * _log_r(logprobs, ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(logp_ref − logp) − 1 − (logp_ref − logp)``."""
    log_r = _log_r(logprobs, ref_logprobs)
    return torch.exp(log_r) - 1.0 - log_r


def kl_penalty(
    token_rewards: torch.Tensor | None,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """KL as a reward penalty: ``token_rewards_t − kl_coef · KL_t`` on trained tokens (no gradient flows).

    With a sequence-level advantage this lowers each score by ``kl_coef · Σ_t KL_t``.
    """
    kl = KL_ESTIMATORS.get(estimator)(logprobs.detach(), ref_logprobs.detach()) * mask
    base = torch.zeros_like(kl) if token_rewards is None else token_rewards.to(kl.dtype)
    return base - kl_coef * kl
