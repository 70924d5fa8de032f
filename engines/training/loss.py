"""The RL loss of one micro-batch, and the tally of its parts over a step.

``loss = agg(w·L_pg) − entropy_coef·agg(H) + kl_coef·agg(KL)``, where ``agg`` (the loss aggregation) normalises
by the counts of the whole step's batch, so micro-batches (and ranks) add up to the gradient of one pass; the
tally adds the parts up the same way, for the step's metrics."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..algorithms.catalog import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from ..settings.training import TrainingSettings
from .batch import Batch
from .logprobs import response_logprobs
from .proximal import InPassProximal

_TOTALS = ("loss", "pg_loss", "entropy_loss", "kl_loss")  # aggregated losses, summed over micro-batches
_SUMS = ("clipped", "entropy", "kl", "ppo_kl", "ratio")  # per-token values, summed over trained tokens


@dataclass
class LossTally:
    """The parts of a step's loss, added up over its micro-batches (and, with :meth:`reduce`, its ranks)."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_TOTALS, 0.0))
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    ratio_max: float = 0.0

    def reduce(self, parallel) -> None:
        """Sum (and for the largest ratio, max) the ranks' tallies: every rank then holds the step's."""
        summed = parallel.sum([*self.totals.values(), *self.sums.values()])
        self.totals = dict(zip(self.totals, summed[: len(self.totals)]))
        self.sums = dict(zip(self.sums, summed[len(self.totals):]))
        self.ratio_max = parallel.max(self.ratio_max)

    def metrics(self, num_tokens: float, with_reference: bool) -> dict[str, float]:
        ntok = max(num_tokens, 1.0)
        metrics = {
            "actor/loss": self.totals["loss"],
            "actor/pg_loss": self.totals["pg_loss"],
            "actor/pg_clipfrac": self.sums["clipped"] / ntok,
            "actor/entropy": self.sums["entropy"] / ntok,
            "actor/ppo_kl": self.sums["ppo_kl"] / ntok,
            "actor/ratio_mean": self.sums["ratio"] / ntok,
            "actor/ratio_max": self.ratio_max,
        }
        if with_reference:
            metrics["actor/kl"] = self.sums["kl"] / ntok
            metrics["actor/kl_loss"] = self.totals["kl_loss"]
        return metrics


def micro_batch_loss(model: torch.nn.Module, mb: Batch, settings: TrainingSettings, norms: dict[str, float],
                     tally: LossTally, *, autocast_dtype: torch.dtype | None = None,
                     proximal: InPassProximal | None = None, rows: Sequence[int] = ()) -> torch.Tensor:
    """The loss of one micro-batch (rows ``rows`` of the step's batch, normalised by its ``norms``), its parts
    added to ``tally``. With ``proximal``, the micro-batch's proximal logprobs and IS weights are taken from this
    forward first."""
    s = settings
    mask = mb.response_mask
    logp, entropy = response_logprobs(model, mb, temperature=s.temperature, with_entropy=True,
                                      entropy_grad=s.entropy_coef > 0, autocast_dtype=autocast_dtype)
    if proximal is not None:
        proximal.take(mb, list(rows), logp)
    out = POLICY_LOSSES.get(s.policy_loss)(logp, mb.old_logprobs, mb.advantages, mask,
                                           clip_low=s.clip_low, clip_high=s.clip_high)
    token_loss = out.token_loss if mb.loss_weights is None else out.token_loss * mb.loss_weights
    agg = LOSS_AGGREGATIONS.get(s.loss_agg)
    pg = agg(token_loss, mask, **norms)
    ent = agg(entropy, mask, **norms)
    loss = pg - s.entropy_coef * ent if s.entropy_coef > 0 else pg
    totals, sums = tally.totals, tally.sums
    if mb.ref_logprobs is not None:
        kl = KL_ESTIMATORS.get(s.kl_estimator)(logp, mb.ref_logprobs)
        kl_term = agg(kl, mask, **norms)
        if s.kl_coef > 0:
            loss = loss + s.kl_coef * kl_term
        totals["kl_loss"] += float(kl_term.detach())
        sums["kl"] += float((kl.detach() * mask).sum())
    totals["loss"] += float(loss.detach())
    totals["pg_loss"] += float(pg.detach())
    totals["entropy_loss"] += float(ent.detach())
    sums["clipped"] += float(out.clipped.sum())
    sums["entropy"] += float((entropy.detach() * mask).sum())
    sums["ppo_kl"] += float(((mb.old_logprobs - logp.detach()) * mask).sum())
    sums["ratio"] += float((out.ratio * mask).sum())
    if mask.any():
        tally.ratio_max = max(tally.ratio_max, float(out.ratio[mask > 0].max()))
    return loss
