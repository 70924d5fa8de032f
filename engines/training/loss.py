"""The RL loss of one micro-batch, and the tally of its parts over a step.

``loss = agg(w·L_pg) − entropy_coef·agg(H) + kl_coef·agg(KL)``, where ``agg`` (the loss aggregation) normalises
by the counts of the whole step's batch, so micro-batches (and ranks) add up to the gradient of one pass; the
tally adds the parts up the same way, for the step's metrics, the policy loss's own shares included (what
dual-clip, CISPO, TOPR... clipped, tapered or gated: ``PolicyLossOutput.metrics``)."""
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
    # the policy loss's own metrics: name -> [sum of values, count of tokens or sequences they were taken over]
    shares: dict[str, list[float]] = field(default_factory=dict)

    def add_shares(self, values: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """Add a loss's metrics: a ``[B, R]`` value over the trained tokens, a ``[B]`` one over the sequences that
        have any."""
        trained = mask > 0
        for name, value in values.items():
            over = trained if value.dim() == 2 else trained.any(-1)
            total = self.shares.setdefault(name, [0.0, 0.0])
            total[0] += float((value.detach().to(torch.float32) * over).sum())
            total[1] += float(over.sum())

    def reduce(self, parallel) -> None:
        """Sum (and for the largest ratio, max) the ranks' tallies: every rank then holds the step's. Every rank
        runs the same loss, so they hold the same share names."""
        names = sorted(self.shares)
        summed = parallel.sum([*self.totals.values(), *self.sums.values(),
                               *(part for name in names for part in self.shares[name])])
        n_totals, n_sums = len(self.totals), len(self.sums)
        self.totals = dict(zip(self.totals, summed[:n_totals]))
        self.sums = dict(zip(self.sums, summed[n_totals:n_totals + n_sums]))
        rest = summed[n_totals + n_sums:]
        self.shares = {name: [rest[2 * k], rest[2 * k + 1]] for k, name in enumerate(names)}
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
        metrics.update({f"actor/{name}": total / count if count else 0.0
                        for name, (total, count) in self.shares.items()})
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
    out = POLICY_LOSSES.get(s.policy_loss)(logp, mb.old_logprobs, mb.advantages, mask, **s.policy_loss_kwargs)
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
    tally.add_shares(getattr(out, "metrics", {}), mask)
    sums["entropy"] += float((entropy.detach() * mask).sum())
    sums["ppo_kl"] += float(((mb.old_logprobs - logp.detach()) * mask).sum())
    sums["ratio"] += float((out.ratio * mask).sum())
    if mask.any():
        tally.ratio_max = max(tally.ratio_max, float(out.ratio[mask > 0].max()))
    return loss
