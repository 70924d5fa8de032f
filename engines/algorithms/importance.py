"""Truncated importance sampling between the behaviour policy (the rollout engine that sampled the tokens,
possibly several versions ago) and the policy the trainer takes its PPO ratio against.

Rollout engines (vLLM, a stale worker, bf16 kernels) do not produce exactly the trainer's probabilities, so the
samples are slightly off-policy. Truncated IS (Ionides 2008; Yao et al. 2025 for LLM RL) reweights each token's
loss by ``w_t = min(exp(logp_old_t − logp_behaviour_t), cap)``: unbiased where the ratio is below the cap,
bounded variance above it.

The correction is chosen by name (``trainer.algorithm.is_correction``, registry ``IMPORTANCE_CORRECTIONS``): the
ratio at one of three levels — per token ``ρ_t``, per sequence ``ρ_i = Π_t ρ_it`` (the exact IS weight of a whole
sample), or its geometric mean ``exp(mean_t log ρ_it)`` (length-normalised: biased, but of usable size on long
answers) — either truncated at ``cap`` (TIS) or masked to 0 outside ``[low, high]`` (MIS: the sample or token is
rejected, its weight is ``ρ`` inside the band). Each correction function::

    fn(log_ratio [B, R], mask [B, R] bool, *, cap, low, high) -> Correction

sees only the corrected rows' trained tokens in ``mask``; :func:`behaviour_weights` gives the other tokens weight 1
and counts what was truncated or masked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .catalog import IMPORTANCE_CORRECTIONS

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


# ----------------------------------------------------------------------------------------- named corrections
@dataclass(frozen=True)
class Correction:
    weights: torch.Tensor  # [B, R] weight of each token (read where the mask is set)
    flagged: torch.Tensor  # bool, [B, R] (per token) or [B] (per sequence): truncated or masked
    action: Literal["truncated", "masked"]


@dataclass
class CorrectionCounts:
    """What a correction did, as sums (so micro-batches and ranks add up): units truncated or masked out of the
    units seen (tokens, or sequences for the sequence levels), and the weights of the corrected tokens."""

    metric: str = "actor/is_token_truncated_frac"
    flagged: float = 0.0
    units: float = 0.0
    weight_sum: float = 0.0
    tokens: float = 0.0

    def add(self, other: "CorrectionCounts") -> None:
        self.metric = other.metric
        self.flagged += other.flagged
        self.units += other.units
        self.weight_sum += other.weight_sum
        self.tokens += other.tokens

    def sums(self) -> list[float]:
        return [self.flagged, self.units, self.weight_sum, self.tokens]

    def metrics(self) -> dict[str, float]:
        """``actor/is_<token|seq>_<truncated|masked>_frac`` and ``actor/is_weight_mean`` (over corrected tokens)."""
        return {self.metric: self.flagged / self.units if self.units else 0.0,
                "actor/is_weight_mean": self.weight_sum / self.tokens if self.tokens else 1.0}


def _sequence(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (log_ratio * mask).sum(-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _geometric(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _truncate(level_log_ratio: torch.Tensor, shape: torch.Size, cap: float) -> Correction:
    ratio = torch.exp(level_log_ratio)
    weights = ratio.clamp(max=cap)
    return Correction(weights[:, None].expand(shape) if ratio.dim() == 1 else weights, ratio > cap, "truncated")


def _mask(level_log_ratio: torch.Tensor, shape: torch.Size, low: float, high: float) -> Correction:
    ratio = torch.exp(level_log_ratio)
    outside = (ratio < low) | (ratio > high)
    weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    return Correction(weights[:, None].expand(shape) if ratio.dim() == 1 else weights, outside, "masked")


def tis(log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float, low: float, high: float) -> Correction:
    """Token TIS: ``w_t = min(ρ_t, cap)``."""
    return _truncate(log_ratio, log_ratio.shape, cap)


def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float, low: float, high: float) -> Correction:
    """IcePop (Ling Team 2025, "Every Step Evolves", Ring-1T): token masking,
    ``w_t = ρ_t · 1[low ≤ ρ_t ≤ high]``, so a token whose trainer and sampler probabilities disagree past the
    band trains nothing (the paper's band: ``[0.5, 5]``)."""
    return _mask(log_ratio, log_ratio.shape, low, high)


def seq_tis(log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float, low: float, high: float) -> Correction:
    """Sequence TIS: ``w_i = min(Π_t ρ_it, cap)`` on every token of sample ``i``."""
    return _truncate(_sequence(log_ratio, mask), log_ratio.shape, cap)


def seq_mis(log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float, low: float, high: float) -> Correction:
    """Sequence MIS: ``w_i = ρ_i · 1[low ≤ ρ_i ≤ high]`` with ``ρ_i = Π_t ρ_it``: a sample the sampler and the
    trainer disagree on as a whole is rejected rather than down-weighted (Liu et al. 2025, "When speed kills
    stability", masked IS)."""
    return _mask(_sequence(log_ratio, mask), log_ratio.shape, low, high)


def geo_tis(log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float, low: float, high: float) -> Correction:
    """Geometric-mean TIS: ``w_i = min(exp((1/|y_i|) Σ_t log ρ_it), cap)`` (GSPO's length-normalised ratio used
    as the weight: biased, bounded variance on long answers)."""
    return _truncate(_geometric(log_ratio, mask), log_ratio.shape, cap)


def geo_mis(log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float, low: float, high: float) -> Correction:
    """Geometric-mean MIS: the sample is rejected when its per-token mean ratio leaves ``[low, high]`` (a band
    that means the same for a short and a long answer), else weighted by it."""
    return _mask(_geometric(log_ratio, mask), log_ratio.shape, low, high)


def behaviour_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: str = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CorrectionCounts]:
    """The loss weights ``[B, R]`` of the named correction of ``ρ = π_old / π_behaviour`` on the trained tokens of
    ``rows`` (bool ``[B]``; all rows when None), 1 on other rows' tokens, 0 where ``mask`` is 0; and its counts."""
    trained = mask > 0
    m = trained if rows is None else trained & rows[:, None]
    log_ratio = (old_logprobs - behaviour_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    out = IMPORTANCE_CORRECTIONS.get(correction)(log_ratio, m, cap=cap, low=low, high=high)
    weights = torch.where(m, out.weights, torch.ones_like(log_ratio)) * trained
    seen = m if out.flagged.dim() == 2 else m.any(-1)
    counts = CorrectionCounts(_metric(out), float((out.flagged & seen).sum()), float(seen.sum()),
                              float((weights * m).sum()), float(m.sum()))
    return weights, counts


def no_corrections(*, correction: str = "tis", cap: float = 2.0, low: float = 0.5,
                   high: float = 2.0) -> CorrectionCounts:
    """Empty counts under the metric name of ``correction`` (what it flags, tokens or sequences, truncated or
    masked: learnt by running it on one token), for a tally that may see no corrected row itself."""
    out = IMPORTANCE_CORRECTIONS.get(correction)(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), cap=cap,
                                                 low=low, high=high)
    return CorrectionCounts(_metric(out))


def _metric(out: Correction) -> str:
    return f"actor/is_{'token' if out.flagged.dim() == 2 else 'seq'}_{out.action}_frac"
