"""How the training engine spreads one optimiser step over the processes of a data-parallel group.

Every rank receives the whole batch of the step (it is small: token ids and a few floats per token) and works
on a contiguous share of its rows:

1. the no-grad forward passes (old and reference logprobs) run on each rank's rows; the results are
   all-gathered, so every rank holds the batch's logprobs;
2. the KL penalty, the advantages and the importance weights are then computed on the *whole* batch, by every
   rank, identically. Estimators that normalise over the batch (REINFORCE++ whitens over all its tokens) stay
   exact, and no estimator has to know about ranks;
3. the backward pass runs on each rank's rows with the normalisers (token and sequence counts) of the whole
   batch. Each rank's loss is then its share of the single-process loss, and the *sum* of the ranks' gradients
   is the single-process gradient; DDP and FSDP average, so the loss is scaled by the world size.

Collectives must be entered by every rank the same number of times: FSDP all-gathers parameters in each
forward. So every rank runs the same number of micro-batches; a rank that has run out of rows runs a padding
micro-batch (one row, nothing trained: zero mask, zero advantage) whose gradient is zero.

Strategies: :class:`SingleProcess` (the identity: one process holds everything), :class:`DDPStrategy` (each
rank a full replica; gradients all-reduced) and :class:`FSDPStrategy` (FSDP2 ``fully_shard`` of each decoder
layer and the root: parameters, gradients and optimiser state are sharded; checkpoints are sharded with
``torch.distributed.checkpoint``).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .batch import Batch
from .micro_batches import MicroBatch, MicroBatching, split


class Checkpointed(Protocol):
    """What a strategy saves and restores of a training engine (:class:`~.engine.TrainingEngine`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    lora: Any  # LoraSettings | None: under LoRA only the adapters are kept
    device: torch.device
    kl_ctrl: Any  # algorithms.kl_control.KlController: the KL penalty's coefficient, when adaptive
    critic: Any  # .critic.Critic | None: the value model of advantage gae, its optimiser and schedule

    @property
    def step(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def restore_schedule(self, scheduler_state: dict[str, Any], step: int) -> None: ...

ENGINE_FILE = "engine.pt"  # single-process and DDP checkpoints: one file, written by rank 0
SHARDED_DIR = "engine"  # FSDP checkpoints: a torch.distributed.checkpoint directory, every rank writes its shard


class SingleProcess:
    """One process trains on the whole batch."""

    name = "single"
    rank = 0
    world_size = 1

    def wrap(self, model: torch.nn.Module, *, trainable: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
        """``(model, the module the training forward goes through)``. ``model`` keeps its Hugging Face names."""
        return model, model

    def rows(self, n: int, rank: int | None = None) -> range:
        """The rows of an ``n``-row batch this rank (or rank ``rank``) works on."""
        rank = self.rank if rank is None else rank
        share = math.ceil(n / self.world_size)
        return range(min(n, rank * share), min(n, (rank + 1) * share))

    def micro_batches(self, batch: Batch, size: MicroBatching | int) -> Iterator[MicroBatch]:
        """This rank's rows of ``batch`` in micro-batches of ``size`` rows, or as a :class:`MicroBatching` says
        (a token budget, packing), the same number on every rank (:mod:`.micro_batches`)."""
        return split(batch, size, self)

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """``local`` holds this rank's rows (``len(self.rows(n))`` of them): the ``[n, ...]`` tensor of all."""
        return local

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, value: float) -> float:
        return value

    @property
    def loss_scale(self) -> float:
        return 1.0

    def gradient_sync(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's backward; ``last``: the step's final one."""
        return contextlib.nullcontext()

    def total_norm(self, norm: torch.Tensor) -> float:
        return float(norm)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a (possibly sharded) parameter or buffer."""
        return tensor

    def save_state(self, engine: Checkpointed, directory: Path) -> None:
        if self.rank == 0:
            with open(directory / ENGINE_FILE, "wb") as fh:
                torch.save(engine.state_dict(), fh)
                fh.flush()
                os.fsync(fh.fileno())

    def load_state(self, engine: Checkpointed, directory: Path) -> None:
        if not (directory / ENGINE_FILE).is_file() and (directory / SHARDED_DIR).is_dir():
            _load_sharded(engine, directory)  # written by FSDP ranks: torch.distributed.checkpoint reshards
            return
        with open(directory / ENGINE_FILE, "rb") as fh:
            engine.load_state_dict(torch.load(fh, map_location=engine.device, weights_only=True))

    def barrier(self) -> None:
        pass


class _Distributed(SingleProcess):
    """What DDP and FSDP share: the rows, gathers and sums over the default process group."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("a distributed trainer needs torch.distributed initialised "
                               "(streamrft.engines.training.ranks.init_ranks, or torchrun)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        share = math.ceil(n / self.world_size)
        padded = local.new_zeros((share, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(parts)[:n]

    def sum(self, values: list[float]) -> list[float]:
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.tolist()

    def max(self, value: float) -> float:
        top = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return float(top)

    @property
    def loss_scale(self) -> float:
        return float(self.world_size)

    def barrier(self) -> None:
        dist.barrier()


class DDPStrategy(_Distributed):
    """Every rank holds the whole model; gradients are all-reduced once per step (after its last micro-batch)."""

    name = "ddp"

    def wrap(self, model: torch.nn.Module, *, trainable: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
        if not trainable:
            return model, model
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        # buffers (rotary frequencies) are the same on every rank: no broadcast before each forward
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **sync)
        return model, ddp

    def gradient_sync(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else model.no_sync()


class FSDPStrategy(_Distributed):
    """FSDP2: each decoder layer (the model's ``_no_split_modules``) and then the root are ``fully_shard``-ed,
    so parameters, gradients and AdamW state are split over the ranks; a layer's parameters are gathered only
    while it runs. Gradients are reduce-scattered after every micro-batch (sharded accumulation)."""

    name = "fsdp"

    def __init__(self, reshard_after_forward: bool = True) -> None:
        super().__init__()
        self.reshard_after_forward = reshard_after_forward
        self._mesh = None

    def _device_mesh(self, device: torch.device):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device.type, (self.world_size,))
        return self._mesh

    def wrap(self, model: torch.nn.Module, *, trainable: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
        from torch.distributed.fsdp import fully_shard

        mesh = self._device_mesh(next(model.parameters()).device)
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
        if not layers:
            raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules): FSDP "
                             "would shard it as one unit; use trainer.parallel: ddp")
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        return model, model

    def total_norm(self, norm: torch.Tensor) -> float:
        from torch.distributed.tensor import DTensor

        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def save_state(self, engine: Checkpointed, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(_sharded_state(engine), checkpoint_id=str(directory / SHARDED_DIR))

    def load_state(self, engine: Checkpointed, directory: Path) -> None:
        if not (directory / SHARDED_DIR).is_dir():
            raise FileNotFoundError(f"{directory} holds a single-process / DDP trainer state ({ENGINE_FILE}), "
                                    "which FSDP ranks do not load: resume it with trainer.parallel: ddp or "
                                    "trainer.nproc: 1")
        _load_sharded(engine, directory)


def _sharded_state(engine: Checkpointed) -> dict[str, Any]:
    """The engine's state in torch.distributed.checkpoint's form (fully qualified names; this rank's shards);
    under LoRA the frozen base is left out (it is the model directory's)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(engine.model, engine.optimizer, options=_state_options(engine))
    state = {"model": model_state, "optimizer": optimizer_state,
             "scheduler": engine.scheduler.state_dict(), "step": engine.step}
    if engine.kl_ctrl.adaptive:  # only then: a checkpoint of a fixed-coefficient run has no such key to load
        state["kl_ctrl"] = engine.kl_ctrl.state_dict()
    if engine.critic is not None:
        state["critic"] = engine.critic.sharded_state()
    return state


def _state_options(engine: Checkpointed):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    adapters_only = engine.lora is not None
    return StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)


def _load_sharded(engine: Checkpointed, directory: Path) -> None:
    """Load a torch.distributed.checkpoint state into the engine, whatever number of ranks wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _sharded_state(engine)
    dcp.load(state, checkpoint_id=str(directory / SHARDED_DIR))
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_state_options(engine))
    engine.restore_schedule(state["scheduler"], int(state["step"]))
    engine.kl_ctrl.load_state_dict(state.get("kl_ctrl"))
    if engine.critic is not None:
        engine.critic.load_sharded(state["critic"])


def strategy(name: str, **options: Any) -> SingleProcess:
    """The strategy called ``name`` (``single``, ``ddp``, ``fsdp``); torch.distributed must be initialised for
    the last two."""
    if name == "single":
        return SingleProcess()
    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp":
        return FSDPStrategy(**options)
    raise ValueError(f"unknown data-parallel strategy {name!r}: single, ddp or fsdp")
