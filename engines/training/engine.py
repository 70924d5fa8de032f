"""The torch training engine: experiences in, one optimiser step out. No Kafka, no config layer.

One training step reads as four stages, each a public method so a trainer can run them separately (several
mini-batches or epochs over one prepared batch, or a test comparing gradients)::

    batch = engine.prepare(experiences, needs_correction=flags)  # collate; old/ref logprobs; KL penalty;
                                                                 # advantages (a teacher's, when distilling:
                                                                 # .distillation); IS weights of flagged rows
    engine.backward(batch)             # micro-batched loss.backward(), gradients accumulate
    engine.apply_gradients()           # clip, AdamW step, lr schedule step
    # == engine.train_step(experiences, needs_correction=flags)

Given a data-parallel strategy (:mod:`.parallel`), every rank of a torch.distributed group runs the same calls on
the same batch and works on its share of the rows; :mod:`.ranks` drives the ranks from the trainer's process.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from streamrft.schemas import Experience

from ..algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    distill,
    kl_penalty,
    truncated_importance_weights,
)
from ..lora import LoraSettings, published_name
from ..models import MODEL_LOAD_LOCK
from .batch import Batch, collate
from .distillation import distill_metrics, keep_rows_with_teacher, teacher_inputs
from .logprobs import response_logprobs
from .parallel import SingleProcess
from .proximal import InPassProximal
from .schedule import build_scheduler
from .settings import TrainingSettings
from .supervised import ObjectiveSplit, train_mixed_step

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _adapter_name(peft_name: str) -> str:
    """A trained adapter parameter's published name: peft's ``base_model.model.`` prefix and adapter name
    (``.default``) dropped, e.g. ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return published_name(peft_name).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


class TrainingEngine:
    """A causal LM, its AdamW optimiser and lr schedule, and the RL loss from the algorithm registries.

    ``ref_model`` is used only when a KL term is on (``settings.needs_reference``); when it is then missing, a
    frozen copy of ``model`` as it is now (the initial policy) is taken. ``parallel`` (default: one process)
    spreads each step over the ranks of a data-parallel group and wraps the models for it (DDP, FSDP2).

    With ``lora`` the policy gets ``peft`` adapters and only they train; :meth:`named_weights` and the
    checkpointed state are the adapters alone (:mod:`streamrft.engines.lora`), and the reference model is the
    base model as loaded.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        settings: TrainingSettings | None = None,
        *,
        ref_model: torch.nn.Module | None = None,
        device: torch.device | str | None = None,
        pad_token_id: int | None = None,
        parallel: SingleProcess | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        self.settings = settings or TrainingSettings()
        self.lora = lora
        s = self.settings
        self.parallel = parallel or SingleProcess()
        self.device = torch.device(device) if device is not None else default_device()
        model = model.to(self.device)
        if s.gradient_checkpointing:  # non-reentrant: the variant DDP and FSDP support
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_model: torch.nn.Module | None = None
        if s.needs_reference:
            ref_model = (ref_model if ref_model is not None else copy.deepcopy(model)).to(self.device)
            ref_model.eval().requires_grad_(False)
            self.ref_model, _ = self.parallel.wrap(ref_model, trainable=False)
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora.peft_config())
        # self.model keeps the Hugging Face names; the training forward goes through self.train_model (DDP's
        # wrapper; the model itself when FSDP2 shards it in place)
        self.model, self.train_model = self.parallel.wrap(model, trainable=True)
        use_bf16 = s.mixed_precision == "bf16" or (s.mixed_precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = int(pad_token_id or 0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=s.lr, betas=s.betas, eps=s.adam_eps, weight_decay=s.weight_decay
        )
        self.scheduler = build_scheduler(self.optimizer, s)
        self._step = 0
        self._grads_pending = False

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        settings: TrainingSettings | None = None,
        *,
        device: torch.device | str | None = None,
        ref_path: str | Path | None = None,
        parallel: SingleProcess | None = None,
        lora: LoraSettings | None = None,
    ) -> "TrainingEngine":
        """Load a Hugging Face model directory in fp32 (master weights; bf16 is autocast on GPU). The reference
        model, when a KL term needs one, is loaded from ``ref_path`` (default: the same directory)."""
        from transformers import AutoModelForCausalLM

        settings = settings or TrainingSettings()
        with MODEL_LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        ref = None
        if settings.needs_reference:
            with MODEL_LOAD_LOCK:
                ref = AutoModelForCausalLM.from_pretrained(str(ref_path or path), dtype=torch.float32)
        return cls(model, settings, ref_model=ref, device=device, parallel=parallel, lora=lora)

    # ------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        """Optimiser steps taken (skipped non-finite steps do not count)."""
        return self._step

    @property
    def lr(self) -> float:
        """The learning rate the next optimiser step will use."""
        return float(self.scheduler.get_last_lr()[0])

    def state_dict(self) -> dict[str, Any]:
        """Model (the adapters alone under LoRA), optimiser, scheduler and step of a single-process engine (a
        sharded one: :meth:`save_state`)."""
        return {
            "model": self._trained_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:
            self._load_adapters(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.restore_schedule(state["scheduler"], int(state["step"]))

    def restore_schedule(self, scheduler_state: dict[str, Any], step: int) -> None:
        self.scheduler.load_state_dict(scheduler_state)
        self._step = step
        self._grads_pending = False

    def save_state(self, directory: str | Path) -> None:
        """Write the engine's state (model, optimiser, scheduler, step) into a checkpoint directory: one file,
        or every rank's shard under FSDP. Every rank calls it, with the same directory."""
        self.parallel.save_state(self, Path(directory))

    def load_state(self, directory: str | Path) -> None:
        """Restore what :meth:`save_state` wrote (every rank, same directory)."""
        self.parallel.load_state(self, Path(directory))

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter and persistent buffer, Hugging Face names, for publishing.

        Tied tensors (e.g. ``lm_head.weight`` sharing ``model.embed_tokens.weight``) are yielded once, under the
        first name, as ``save_pretrained`` does. Tensors are detached views of the live weights (cast copies
        when ``dtype`` is given): consume them before the next optimiser step. Under FSDP each tensor is
        gathered whole as it is reached (every rank iterates, in step), so at most one extra parameter is
        materialised at a time.
        """
        if self.lora is not None:
            for name, tensor in self._trained_state().items():
                tensor = self.parallel.full_tensor(tensor.detach())
                yield _adapter_name(name), tensor if dtype is None else tensor.to(dtype)
            return
        # deduplicated by name (the first module path of a tied parameter), the same on every rank; storage
        # pointers are not: a rank's shard of a small parameter may be empty
        unique = {name for name, _ in self.model.named_parameters()} | {name for name, _ in self.model.named_buffers()}
        for name, tensor in self.model.state_dict().items():
            if name not in unique:
                continue
            tensor = self.parallel.full_tensor(tensor.detach())
            yield name, tensor if dtype is None else tensor.to(dtype)

    def publish_metadata(self) -> dict[str, str]:
        """What a published version's manifest says about its tensors (that they are an adapter, and which)."""
        return self.lora.metadata() if self.lora is not None else {}

    def _trained_state(self) -> dict[str, torch.Tensor]:
        """The state a checkpoint keeps of the model: all of it, or under LoRA the adapters (peft's names)."""
        state = self.model.state_dict()
        if self.lora is None:
            return state
        trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {name: tensor for name, tensor in state.items() if name in trained}

    def _load_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        expected = set(self._trained_state())
        if set(adapters) != expected:
            missing, unknown = sorted(expected - set(adapters)), sorted(set(adapters) - expected)
            raise ValueError(f"the checkpoint's adapters do not match model.lora: missing {missing[:3]}, "
                             f"unknown {unknown[:3]} (was it written with other lora settings, or without LoRA?)")
        self.model.load_state_dict(adapters, strict=False)

    # ------------------------------------------------------------------ stages

    def collate(self, experiences: Sequence[Experience], needs_correction: Sequence[bool] | None = None) -> Batch:
        batch = collate(experiences, pad_token_id=self.pad_token_id, needs_correction=needs_correction)
        return batch.to(self.device)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Response logprobs ``[B, R]`` under ``model`` (default: the policy), micro-batched, no gradient; each
        rank computes its rows and all ranks get the whole matrix."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        rows = self.parallel.rows(len(batch))
        out = batch.behaviour_logprobs.new_zeros((len(rows), batch.response_width))
        try:
            for mb in self.parallel.micro_batches(batch, self.settings.micro_batch_size):
                logp, _ = response_logprobs(
                    model, mb.batch, temperature=self.settings.temperature, autocast_dtype=self.autocast_dtype
                )
                if not mb.padding:
                    out[[row - rows.start for row in mb.rows], : logp.shape[1]] = logp
        finally:
            model.train(was_training)
        return self.parallel.gather_rows(out, len(batch)) * batch.response_mask

    def prepare(
        self, experiences: Sequence[Experience] | Batch, needs_correction: Sequence[bool] | None = None, *,
        one_update: bool = False,
    ) -> Batch:
        """Collate (unless given a Batch) and fill what the loss needs: old and reference logprobs, KL reward
        penalty, advantages, truncated importance weights. Batch-level metrics land in ``batch.metrics``.

        ``one_update``: the batch trains exactly one optimiser step. The recomputed old (proximal) logprobs and
        the IS weights then come from the training forward itself (:mod:`.proximal`), a forward pass less, when
        nothing needs them before the loss (no KL reward penalty) and the model has no dropout."""
        s = self.settings
        batch = experiences if isinstance(experiences, Batch) else self.collate(experiences, needs_correction)
        batch = batch.to(self.device)
        mask = batch.response_mask
        corrected = torch.ones_like(batch.needs_correction) if s.reweights_every_row else batch.needs_correction
        recompute = s.recompute_old_logprobs or bool(corrected.any())
        in_pass = recompute and one_update and self.proximal_in_pass_possible
        if in_pass:
            batch.proximal_in_pass, batch.reweighted_rows = True, corrected
        else:
            batch.old_logprobs = self.compute_logprobs(batch) if recompute else batch.behaviour_logprobs
        if self.ref_model is not None:
            batch.ref_logprobs = self.compute_logprobs(batch, self.ref_model)
        metrics: dict[str, float] = {}

        token_rewards = batch.token_rewards
        if s.kl_penalty_coef > 0:
            token_rewards = kl_penalty(
                token_rewards, batch.old_logprobs, batch.ref_logprobs, mask,
                kl_coef=s.kl_penalty_coef, estimator=s.kl_penalty_estimator,
            )
            kl = KL_ESTIMATORS.get(s.kl_penalty_estimator)(batch.old_logprobs, batch.ref_logprobs)
            metrics["actor/kl_penalty"] = _masked_mean(kl, mask)
        if s.uses_teacher:  # on-policy distillation: rows without the teacher's logprobs stay out of the loss
            metrics["distill/rows_without_teacher"] = float(keep_rows_with_teacher(batch))
            mask = batch.response_mask
        advantage_fn = ADVANTAGES.get(s.advantage)
        batch.advantages = advantage_fn(
            batch.rewards, mask, batch.group_ids, token_rewards=token_rewards,
            **teacher_inputs(advantage_fn, batch), **s.advantage_params
        ).to(mask.dtype)
        if s.distill_coef > 0:  # distillation beside the task reward
            batch.advantages = batch.advantages + s.distill_coef * distill(
                batch.rewards, mask, batch.group_ids, **teacher_inputs(distill, batch)).to(mask.dtype)
        metrics.update(distill_metrics(batch, mask))
        if s.mask_truncated:  # after the advantages: a truncated sample still counts in its group's baseline
            metrics["actor/num_masked_truncated"] = float(batch.truncated.sum())
            mask = batch.response_mask = mask * (~batch.truncated).to(mask.dtype)[:, None]
            batch.advantages = batch.advantages * mask

        if recompute and not in_pass:  # rollout-vs-trainer mismatch, reported whether or not it is corrected
            seen = truncated_importance_weights(batch.old_logprobs, batch.behaviour_logprobs, mask, cap=s.tis_cap)
            metrics.update(seen.metrics())
        if corrected.any() and not in_pass:
            batch.loss_weights = truncated_importance_weights(
                batch.old_logprobs, batch.behaviour_logprobs, mask, cap=s.tis_cap, rows=corrected
            ).weights
        lengths = batch.response_lengths.to(torch.float32)
        metrics.update({
            "actor/reward_mean": float(batch.rewards.mean()),
            "actor/reward_std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
            "actor/advantage_mean": _masked_mean(batch.advantages, mask),
            "actor/advantage_abs_mean": _masked_mean(batch.advantages.abs(), mask),
            "actor/response_length_mean": float(lengths.mean()),
            "actor/num_sequences": float(len(batch)),
            "actor/num_tokens": float(mask.sum()),
            "actor/num_corrected": float(corrected.sum()),
        })
        batch.metrics = metrics
        return batch

    def backward(self, batch: Batch, weight: float = 1.0) -> dict[str, float]:
        """Accumulate gradients of ``weight`` × the loss over ``batch`` in micro-batches; returns loss metrics
        (of the loss itself: ``weight`` is the RL rows' share of a step that also trains supervised rows).

        ``loss = agg(w·L_pg) − entropy_coef·agg(H) + kl_coef·agg(KL)`` where ``agg`` normalises by the counts of
        the whole ``batch`` — so micro-batching gives the same gradient as one pass, and so does spreading the
        rows over ranks (the metrics are summed over them). Gradients from earlier ``backward`` calls since the
        last :meth:`apply_gradients` are kept (accumulated).
        """
        if batch.advantages is None or (batch.old_logprobs is None and not batch.proximal_in_pass):
            raise RuntimeError("batch is not prepared: call TrainingEngine.prepare() first")
        s = self.settings
        proximal = InPassProximal(batch, self.parallel, s.tis_cap) if batch.proximal_in_pass else None
        self.begin_accumulation()
        norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(len(batch))}
        ntok = max(norms["num_tokens"], 1.0)
        totals = dict.fromkeys(("loss", "pg_loss", "entropy_loss", "kl_loss"), 0.0)
        sums = dict.fromkeys(("clipped", "entropy", "kl", "ppo_kl", "ratio"), 0.0)
        ratio_max = 0.0
        self.model.train()
        micro_batches = list(self.parallel.micro_batches(batch, s.micro_batch_size))
        for k, micro in enumerate(micro_batches):
            # DDP decides at the forward whether the backward all-reduces: once, after the last micro-batch
            with self.parallel.gradient_sync(self.train_model, last=k == len(micro_batches) - 1):
                loss, largest_ratio = self._micro_batch_loss(micro.batch, norms, totals, sums, proximal, micro.rows)
                (loss * weight * self.parallel.loss_scale).backward()  # DDP/FSDP average the ranks' gradients; we sum
            ratio_max = max(ratio_max, largest_ratio)
        summed = self.parallel.sum([*totals.values(), *sums.values()])
        totals = dict(zip(totals, summed[: len(totals)]))
        sums = dict(zip(sums, summed[len(totals):]))
        ratio_max = self.parallel.max(ratio_max)
        metrics = {
            "actor/loss": totals["loss"],
            "actor/pg_loss": totals["pg_loss"],
            "actor/pg_clipfrac": sums["clipped"] / ntok,
            "actor/entropy": sums["entropy"] / ntok,
            "actor/ppo_kl": sums["ppo_kl"] / ntok,
            "actor/ratio_mean": sums["ratio"] / ntok,
            "actor/ratio_max": ratio_max,
        }
        if batch.ref_logprobs is not None:
            metrics["actor/kl"] = sums["kl"] / ntok
            metrics["actor/kl_loss"] = totals["kl_loss"]
        if proximal is not None:
            metrics.update(proximal.finish())
        return metrics

    def _micro_batch_loss(self, mb: Batch, norms: dict[str, float], totals: dict[str, float],
                          sums: dict[str, float], proximal: InPassProximal | None = None,
                          rows: Sequence[int] = ()) -> tuple[torch.Tensor, float]:
        """The loss of one micro-batch (rows ``rows`` of the step's batch, normalised by its ``norms``) and its
        largest ratio (0 with no trained token); adds its metrics' parts to ``totals`` and ``sums``. With
        ``proximal``, the micro-batch's proximal logprobs and IS weights are taken from this forward first."""
        s = self.settings
        mask = mb.response_mask
        logp, entropy = response_logprobs(
            self.train_model, mb, temperature=s.temperature, with_entropy=True,
            entropy_grad=s.entropy_coef > 0, autocast_dtype=self.autocast_dtype,
        )
        if proximal is not None:
            proximal.take(mb, list(rows), logp)
        out = POLICY_LOSSES.get(s.policy_loss)(logp, mb.old_logprobs, mb.advantages, mask,
                                               clip_low=s.clip_low, clip_high=s.clip_high)
        token_loss = out.token_loss if mb.loss_weights is None else out.token_loss * mb.loss_weights
        agg = LOSS_AGGREGATIONS.get(s.loss_agg)
        pg = agg(token_loss, mask, **norms)
        ent = agg(entropy, mask, **norms)
        loss = pg - s.entropy_coef * ent if s.entropy_coef > 0 else pg
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
        return loss, float(out.ratio[mask > 0].max()) if mask.any() else 0.0

    def begin_accumulation(self) -> None:
        """Zero the gradients, unless a backward since the last :meth:`apply_gradients` already holds some (every
        backward of a step adds to the same gradients)."""
        if not self._grads_pending:
            self.optimizer.zero_grad(set_to_none=True)
            self._grads_pending = True

    def apply_gradients(self) -> dict[str, float]:
        """Clip the accumulated gradients to ``max_grad_norm``, step AdamW and the lr schedule.

        A non-finite gradient norm skips the update (``actor/skipped_step`` = 1) and leaves step and lr as they
        were. The gradients stay readable until the next :meth:`backward`.
        """
        if not self._grads_pending:
            raise RuntimeError("no gradients to apply: call backward() first")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm is not None else math.inf
        grad_norm = self.parallel.total_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = self.lr
        self._grads_pending = False
        if not math.isfinite(grad_norm):
            logger.warning("non-finite gradient norm (%s) at step %d: update skipped", grad_norm, self._step)
            self.optimizer.zero_grad(set_to_none=True)
            return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/skipped_step": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        self._step += 1
        return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/skipped_step": 0.0}

    def optimizer_step(self, batch: Batch) -> dict[str, float]:
        """:meth:`backward` + :meth:`apply_gradients` on a prepared batch; all metrics, batch ones included."""
        metrics = dict(batch.metrics)
        metrics.update(self.backward(batch))
        metrics.update(self.apply_gradients())
        return metrics

    def train_step(
        self, experiences: Sequence[Experience], needs_correction: Sequence[bool] | None = None
    ) -> dict[str, float]:
        """One full step on complete groups of experiences: prepare + one optimiser step. Supervised rows (SFT,
        DPO) train beside the RL rows, each objective's loss weighted by its share of the rows (:mod:`.supervised`)."""
        split = ObjectiveSplit.of(experiences, needs_correction)
        if not split.only_rl:
            return train_mixed_step(self, split)
        return self.optimizer_step(self.prepare(experiences, needs_correction, one_update=True))

    @functools.cached_property
    def proximal_in_pass_possible(self) -> bool:
        """Whether a batch that trains one update may take its proximal logprobs from the training forward
        (:mod:`.proximal`): nothing needs them before the loss (a KL reward penalty does, for the advantages),
        and the train-mode forward computes what the eval-mode one would (no dropout)."""
        if self.settings.kl_penalty_coef > 0:
            return False
        config = getattr(self.model, "config", None)
        if getattr(config, "attention_dropout", 0.0):  # Llama-style: functional, in train mode only
            return False
        return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())
