"""Proximal logprobs taken from the training pass itself.

The PPO ratio's denominator (and decoupled PPO's proximal policy, and the truncated IS weights' numerator) is
the policy's logprob under the weights *before* the optimiser step. When a prepared batch trains exactly one
step (``TrainingEngine.train_step``), those weights are the ones the training forward runs with, so the forward
that computes the loss already holds these logprobs: detached, they are the proximal logprobs. Taking them there
saves the separate no-grad forward pass ``prepare`` would run, about a quarter of a step's compute (a forward
against forward + backward).

The values are the same up to float noise: the same weights, inputs and autocast, in train mode rather than eval
mode, which is why ``TrainingEngine`` takes this path only for a model without dropout. With one update the
ratio is then exactly 1 in value, and its gradient is the policy gradient, as it would be with the recomputed
denominator.

What ``prepare`` computes from the proximal logprobs before the loss is computed here per micro-batch: the
truncated IS weights of the rows that need them, and the rollout-vs-trainer mismatch statistics, summed over
micro-batches and ranks. After the pass the batch holds its proximal logprobs and weights as a prepared batch
would, so further backward passes on it (epochs) use them as usual.
"""
from __future__ import annotations

import math

import torch

from ..algorithms import behaviour_weights, no_corrections, truncated_importance_weights
from ..settings.training import TrainingSettings
from .batch import Batch


class InPassProximal:
    """Collects one backward pass's proximal logprobs, IS weights and mismatch statistics (this rank's rows)."""

    def __init__(self, batch: Batch, parallel, correction: dict):
        self.batch = batch
        self.parallel = parallel
        self.correction = correction  # behaviour_weights' keywords (TrainingSettings.correction_kwargs)
        self.cap = correction["cap"]
        self.applied = no_corrections(**correction)  # this rank may hold no corrected row
        self.rows = parallel.rows(len(batch))
        self.logprobs = batch.behaviour_logprobs.new_zeros((len(self.rows), batch.response_width))
        self.weights = torch.ones_like(self.logprobs) if self._reweights(batch) else None
        self.ratio_sum = self.tokens = self.truncated = 0.0
        self.ratio_min, self.ratio_max = math.inf, 0.0

    @staticmethod
    def _reweights(batch: Batch) -> bool:
        return batch.reweighted_rows is not None and bool(batch.reweighted_rows.any())

    def take(self, micro: Batch, rows: list[int], logprobs: torch.Tensor) -> None:
        """Give ``micro`` (rows ``rows`` of the batch; none for a padding micro-batch) its proximal logprobs and IS
        weights from the training forward's ``logprobs``, before its loss is computed."""
        proximal = logprobs.detach()
        micro.old_logprobs = proximal
        mask = micro.response_mask
        seen = truncated_importance_weights(proximal, micro.behaviour_logprobs, mask, cap=self.cap)
        tokens = float((mask > 0).sum())
        if tokens:
            self.tokens += tokens
            self.ratio_sum += seen.ratio_mean * tokens
            self.truncated += seen.truncated_fraction * tokens
            self.ratio_min = min(self.ratio_min, seen.ratio_min)
            self.ratio_max = max(self.ratio_max, seen.ratio_max)
        if self._reweights(micro):
            micro.loss_weights, applied = behaviour_weights(proximal, micro.behaviour_logprobs, mask,
                                                            rows=micro.reweighted_rows, **self.correction)
            self.applied.add(applied)
        if rows:
            local = [row - self.rows.start for row in rows]
            self.logprobs[local, : proximal.shape[1]] = proximal
            if self.weights is not None and micro.loss_weights is not None:
                self.weights[local, : proximal.shape[1]] = micro.loss_weights

    def finish(self) -> dict[str, float]:
        """Store the whole batch's proximal logprobs (and weights) on it; the mismatch statistics of all ranks."""
        batch = self.batch
        batch.old_logprobs = self.parallel.gather_rows(self.logprobs, len(batch)) * batch.response_mask
        if self.weights is not None:
            batch.loss_weights = self.parallel.gather_rows(self.weights, len(batch)) * (batch.response_mask > 0)
        batch.proximal_in_pass = False
        ratio_sum, tokens, truncated = self.parallel.sum([self.ratio_sum, self.tokens, self.truncated])
        ratio_max = self.parallel.max(self.ratio_max)
        ratio_min = -self.parallel.max(-self.ratio_min)
        applied = {}
        if self.weights is not None:  # the same on every rank: the batch's
            self.applied.flagged, self.applied.units, self.applied.weight_sum, self.applied.tokens = \
                self.parallel.sum(self.applied.sums())
            applied = self.applied.metrics()
        if not tokens:
            return {"actor/is_ratio_mean": 1.0, "actor/is_ratio_min": 1.0, "actor/is_ratio_max": 1.0,
                    "actor/is_truncated_frac": 0.0, **applied}
        return {"actor/is_ratio_mean": ratio_sum / tokens, "actor/is_ratio_min": ratio_min,
                "actor/is_ratio_max": ratio_max, "actor/is_truncated_frac": truncated / tokens, **applied}


def proximal_in_pass_possible(model: torch.nn.Module, settings: TrainingSettings) -> bool:
    """Whether a batch that trains one update may take its proximal logprobs from the training forward: nothing
    needs them before the loss (a KL reward penalty does, for the advantages), and the train-mode forward
    computes what the eval-mode one would (no dropout)."""
    if settings.kl_penalty_coef > 0:
        return False
    config = getattr(model, "config", None)
    if getattr(config, "attention_dropout", 0.0):  # Llama-style: functional, in train mode only
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
