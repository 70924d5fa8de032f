"""The critic of PPO with a critic (``trainer.algorithm.advantage: gae``): a value model trained by the trainer
beside the policy, with its own AdamW, lr schedule, gradient clipping and checkpointed state.

In a training step (:class:`~.engine.TrainingEngine`):

1. ``prepare`` asks :meth:`Critic.values` for ``V(s_t)`` of every response token (no gradient; each rank its rows,
   then gathered), from which the advantage ``gae`` and the critic's targets, the λ-returns, are computed
   (:mod:`streamrft.engines.algorithms.gae`);
2. :meth:`Critic.update` takes one optimiser step of the clipped value loss
   (:mod:`streamrft.engines.algorithms.value_loss`) on the batch, in micro-batches whose losses are normalised by
   the whole batch's counts (so micro-batches and ranks add up to one pass, as for the policy);
3. the policy trains on the advantages, unless the critic is still warming up (``critic_warmup``: the first
   steps train the critic alone, so the policy starts from a baseline worth following).

The values are the trainer's alone: the explorer, the workers and the records do not change.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from ..algorithms.catalog import LOSS_AGGREGATIONS
from ..algorithms.value_loss import clipped_value_loss
from ..settings.lora import LoraSettings
from ..settings.training import TrainingSettings
from .batch import Batch
from .micro_batches import MicroBatching
from .packing import check_packable
from .parallel import SingleProcess
from .schedule import build_scheduler
from .trained_state import load_trained_state, trained_state
from .value_model import build_value_model, response_values

if TYPE_CHECKING:
    from .supervised import ObjectiveSplit, StepEngine

logger = logging.getLogger(__name__)

EXPLAINED_VAR_EPS = 1e-5  # veRL's, in 1 − Var(R − V)/(Var(R) + eps)


class Critic:
    """The value model of a policy (:func:`~.value_model.build_value_model`), wrapped by the engine's
    data-parallel strategy as the policy is, and its optimiser and schedule. Build it before LoRA or the wrap
    change the policy."""

    def __init__(self, policy: torch.nn.Module, settings: TrainingSettings, *, device: torch.device,
                 parallel: SingleProcess, lora: LoraSettings | None = None,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.settings = settings
        self.parallel = parallel
        self.lora = lora
        c = settings.critic_schedule
        self.model, self.train_model = parallel.wrap(build_value_model(policy, settings, lora).to(device),
                                                     trainable=True)
        self.autocast_dtype = autocast_dtype  # the policy's (engines/precision.py), decided once for both
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=c.lr, betas=settings.betas, eps=settings.adam_eps,
                                           weight_decay=c.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, c)  # the critic's fields: lr_schedule, warmup_steps, ...
        # the policy's rows or token budget per micro-batch, packed where the policy's are
        self.micro_batching = MicroBatching.of(settings)
        if self.micro_batching.pack:
            check_packable(self.model)  # a critic of another architecture must confine attention too
        self._step = 0

    @property
    def step(self) -> int:
        """The critic's optimiser steps (skipped non-finite ones do not count)."""
        return self._step

    @property
    def warming_up(self) -> bool:
        """The critic trains alone this step (``critic_warmup``)."""
        return self._step < self.settings.critic.critic_warmup

    # ------------------------------------------------------------------ training

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """``V(s_t)`` ``[B, R]`` of ``batch`` (0 off the response mask): each rank its rows, every rank the whole."""
        was_training = self.model.training
        self.model.eval()
        rows = self.parallel.rows(len(batch))
        out = batch.behaviour_logprobs.new_zeros((len(rows), batch.response_width))
        try:
            for mb in self.parallel.micro_batches(batch, self.micro_batching):
                v = response_values(self.train_model, mb.batch, self.autocast_dtype)
                if not mb.padding:
                    out[[row - rows.start for row in mb.rows], : v.shape[1]] = v
        finally:
            self.model.train(was_training)
        return self.parallel.gather_rows(out, len(batch)) * batch.response_mask

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimiser step of the value loss on a prepared batch (its ``values`` and ``returns`` set);
        ``critic/*`` metrics."""
        if batch.values is None or batch.returns is None:
            raise RuntimeError("the batch has no values or returns: prepare it with a critic (advantage: gae)")
        s, c = self.settings, self.settings.critic
        norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(len(batch))}
        agg = LOSS_AGGREGATIONS.get(s.loss_agg)
        sums = dict.fromkeys(("vf_loss", "clipped", "vpred"), 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        micro_batches = list(self.parallel.micro_batches(batch, self.micro_batching))
        for k, micro in enumerate(micro_batches):
            mb = micro.batch
            with self.parallel.gradient_sync(self.train_model, last=k == len(micro_batches) - 1):
                vpred = response_values(self.train_model, mb, self.autocast_dtype)
                out = clipped_value_loss(vpred, mb.values, mb.returns, mb.response_mask,
                                         cliprange_value=c.cliprange_value)
                loss = agg(out.token_loss, mb.response_mask, **norms)
                (loss * self.parallel.loss_scale).backward()
            sums["vf_loss"] += float(loss.detach())
            sums["clipped"] += float(out.clipped.sum())
            sums["vpred"] += float((vpred.detach() * mb.response_mask).sum())
        sums = dict(zip(sums, self.parallel.sum(list(sums.values()))))
        ntok = max(norms["num_tokens"], 1.0)
        metrics = {"critic/vf_loss": sums["vf_loss"], "critic/vf_clipfrac": sums["clipped"] / ntok,
                   "critic/vpred_mean": sums["vpred"] / ntok, **value_metrics(batch)}
        metrics.update(self._apply_gradients())
        return metrics

    def _apply_gradients(self) -> dict[str, float]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.settings.critic.max_grad_norm or math.inf
        grad_norm = self.parallel.total_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = float(self.scheduler.get_last_lr()[0])
        if not math.isfinite(grad_norm):
            logger.warning("critic: non-finite gradient norm (%s) at its step %d: update skipped", grad_norm,
                           self._step)
            self.optimizer.zero_grad(set_to_none=True)
            return {"critic/grad_norm": grad_norm, "critic/lr": lr, "critic/skipped_step": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        self._step += 1
        return {"critic/grad_norm": grad_norm, "critic/lr": lr, "critic/skipped_step": 0.0}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Weights (under LoRA the adapters and the value head), optimiser, scheduler and step of a single-process
        or DDP critic (a sharded one: :meth:`sharded_state`)."""
        return {"model": trained_state(self.model, adapters_only=self.lora is not None),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self._step}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint of a run without a critic) keeps this one as built."""
        if state is None:
            logger.warning("the checkpoint holds no critic (written by a run without advantage: gae): the critic "
                           "starts afresh")
            return
        load_trained_state(self.model, state["model"], adapters_only=self.lora is not None)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._step = int(state["step"])

    def sharded_state(self) -> dict[str, Any]:
        """The state in torch.distributed.checkpoint's form (this rank's shards; under LoRA no frozen base)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return {"model": model_state, "optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(),
                "step": self._step}

    def load_sharded(self, state: dict[str, Any]) -> None:
        """Restore what torch.distributed.checkpoint read into a :meth:`sharded_state` structure."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=self._state_options())
        self.scheduler.load_state_dict(state["scheduler"])
        self._step = int(state["step"])

    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        adapters_only = self.lora is not None
        return StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)


def value_metrics(batch: Batch) -> dict[str, float]:
    """What the values the advantages used say (veRL's data metrics): their mean, the returns' mean, and the
    share of the returns' variance they explain, ``1 − Var(R − V)/Var(R)`` over the trained tokens."""
    mask = batch.response_mask
    count = mask.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / count
        return (((x - mean) * mask) ** 2).sum() / count

    explained = 1.0 - var(batch.returns - batch.values) / (var(batch.returns) + EXPLAINED_VAR_EPS)
    return {"critic/value_explained_var": float(explained),
            "critic/values_mean": float((batch.values * mask).sum() / count),
            "critic/returns_mean": float((batch.returns * mask).sum() / count)}


def critic_only_step(engine: StepEngine, split: ObjectiveSplit) -> dict[str, float]:
    """A step of the critic's warm-up: the RL rows of ``split`` are prepared (values, advantages, returns) and
    train the critic; the policy and its schedule do not move (nor do supervised rows train)."""
    metrics = {"critic/warmup": 1.0}
    if split.rl:
        batch = engine.prepare(split.rl, split.rl_flags, one_update=True)
        metrics.update(batch.metrics)
        metrics.update(engine.critic.update(batch))
    return metrics
