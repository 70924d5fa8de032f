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

from ..algorithms import behaviour_weights, truncated_importance_weights
from ..algorithms.kl_control import KlController
from ..lora import published_name
from ..settings.lora import LoraSettings
from ..models import MODEL_LOAD_LOCK
from .advantage_step import batch_metrics, fill_advantages
from .batch import Batch, collate
from .critic import Critic, critic_only_step
from .logprobs import batch_logprobs
from .loss import LossTally, micro_batch_loss
from .micro_batches import MicroBatching
from .parallel import SingleProcess
from ..precision import autocast_dtype
from .proximal import InPassProximal, proximal_in_pass_possible
from .schedule import build_scheduler
from ..settings.training import TrainingSettings
from .supervised import ObjectiveSplit, train_mixed_step
from .trained_state import load_trained_state, trained_state

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _adapter_name(peft_name: str) -> str:
    """A trained adapter parameter's published name: peft's ``base_model.model.`` prefix and adapter name
    (``.default``) dropped, e.g. ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return published_name(peft_name).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


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
        self.autocast_dtype = autocast_dtype(s.mixed_precision, self.device, self.parallel)  # the critic's too
        # PPO with a critic: the value model copies the policy's backbone before LoRA and the wrap change it
        self.critic = Critic(model, s, device=self.device, parallel=self.parallel, lora=lora,
                             autocast_dtype=self.autocast_dtype) if s.uses_critic else None
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora.peft_config())
        # self.model keeps the Hugging Face names; the training forward goes through self.train_model (DDP's
        # wrapper; the model itself when FSDP2 shards it in place)
        self.model, self.train_model = self.parallel.wrap(model, trainable=True)
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = int(pad_token_id or 0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=s.lr, betas=s.betas, eps=s.adam_eps, weight_decay=s.weight_decay
        )
        self.scheduler = build_scheduler(self.optimizer, s)
        # the KL reward penalty's coefficient (moves under kl_ctrl: adaptive; checkpointed with the engine)
        self.kl_ctrl = KlController(s.kl_penalty_coef, s.target_kl if s.kl_ctrl == "adaptive" else None,
                                    s.kl_horizon)
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
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **settings.model_load_kwargs)
        ref = None
        if settings.needs_reference:
            with MODEL_LOAD_LOCK:
                ref = AutoModelForCausalLM.from_pretrained(str(ref_path or path), dtype=torch.float32,
                                                           **settings.model_load_kwargs)
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
            "model": trained_state(self.model, adapters_only=self.lora is not None),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self._step,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            **({"critic": self.critic.state_dict()} if self.critic is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_trained_state(self.model, state["model"], adapters_only=self.lora is not None)
        self.optimizer.load_state_dict(state["optimizer"])
        self.restore_schedule(state["scheduler"], int(state["step"]))
        self.kl_ctrl.load_state_dict(state.get("kl_ctrl"))
        if self.critic is not None:
            self.critic.load_state_dict(state.get("critic"))

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
            for name, tensor in trained_state(self.model, adapters_only=True).items():
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

    # ------------------------------------------------------------------ stages

    def collate(self, experiences: Sequence[Experience], needs_correction: Sequence[bool] | None = None) -> Batch:
        batch = collate(experiences, pad_token_id=self.pad_token_id, needs_correction=needs_correction)
        return batch.to(self.device)

    def compute_logprobs(self, batch: Batch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Response logprobs ``[B, R]`` under ``model`` (default: the policy), no gradient (:func:`batch_logprobs`)."""
        return batch_logprobs(self.model if model is None else model, batch, self.parallel,
                              MicroBatching.of(self.settings), self.settings.temperature, self.autocast_dtype)

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
        if self.critic is not None:
            batch.values = self.critic.values(batch)
        metrics = fill_advantages(batch, s, self.kl_ctrl)
        mask = batch.response_mask
        if recompute and not in_pass:  # rollout-vs-trainer mismatch, reported whether or not it is corrected
            seen = truncated_importance_weights(batch.old_logprobs, batch.behaviour_logprobs, mask, cap=s.tis_cap)
            metrics.update(seen.metrics())
        if corrected.any() and not in_pass:
            batch.loss_weights, applied = behaviour_weights(batch.old_logprobs, batch.behaviour_logprobs, mask,
                                                            rows=corrected, **s.correction_kwargs)
            metrics.update(applied.metrics())
        batch.metrics = metrics | batch_metrics(batch, corrected)
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
        proximal = InPassProximal(batch, self.parallel, s.correction_kwargs) if batch.proximal_in_pass else None
        self.begin_accumulation()
        norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(len(batch))}
        tally = LossTally()
        self.model.train()
        micro_batches = list(self.parallel.micro_batches(batch, MicroBatching.of(s)))
        for k, micro in enumerate(micro_batches):
            # DDP decides at the forward whether the backward all-reduces: once, after the last micro-batch
            with self.parallel.gradient_sync(self.train_model, last=k == len(micro_batches) - 1):
                loss = micro_batch_loss(self.train_model, micro.batch, s, norms, tally,
                                        autocast_dtype=self.autocast_dtype, proximal=proximal, rows=micro.rows)
                (loss * weight * self.parallel.loss_scale).backward()  # DDP/FSDP average the ranks' gradients; we sum
        tally.reduce(self.parallel)
        metrics = tally.metrics(norms["num_tokens"], with_reference=batch.ref_logprobs is not None)
        if proximal is not None:
            metrics.update(proximal.finish())
        return metrics

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
        """The critic's update (with one), :meth:`backward` + :meth:`apply_gradients` on a prepared batch; all
        metrics, batch ones included."""
        metrics = dict(batch.metrics)
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        metrics.update(self.backward(batch))
        metrics.update(self.apply_gradients())
        return metrics

    def train_step(
        self, experiences: Sequence[Experience], needs_correction: Sequence[bool] | None = None
    ) -> dict[str, float]:
        """One full step on complete groups of experiences: prepare + one optimiser step. Supervised rows (SFT,
        DPO) train beside the RL rows, each objective's loss weighted by its share of the rows (:mod:`.supervised`)."""
        split = ObjectiveSplit.of(experiences, needs_correction)
        if self.critic is not None and self.critic.warming_up:
            return critic_only_step(self, split)
        # CHORD weighs the RL loss by 1 − μ in every step, whether or not the SFT reader had rows to give
        if not split.only_rl or self.settings.mix_weighting == "chord":
            return train_mixed_step(self, split)
        return self.optimizer_step(self.prepare(experiences, needs_correction, one_update=True))

    @functools.cached_property
    def proximal_in_pass_possible(self) -> bool:
        """Whether a batch that trains one update may take its proximal logprobs from the training forward."""
        return proximal_in_pass_possible(self.model, self.settings)
