"""A distributed trainer's ranks, driven from rank 0.

How the ranks share the ``experiences`` stream: **rank 0 alone reads, commits and checkpoints; it hands each
step's batch to every rank.** Exactly-once then needs nothing new: one consumer, one transactional producer,
one set of offsets per checkpoint, exactly as with one process. The alternative, each rank reading its own
partitions, would need one transaction spanning the ranks' offsets (Kafka has none across producers) and would
tie the number of ranks to the partition count and to GRPO groups (a group's experiences span partitions).
The batch itself is small (token ids and a few floats per token, kilobytes to a few MB); the model work
(forward, backward, optimiser) is what is spread, by :mod:`.parallel`.

Rank 0 holds a :class:`RankZeroEngine`: the trainer calls it like a :class:`TrainingEngine`, and each call
that every rank must make in step (a training step, a checkpoint save or load, gathering the weights for a
publish) is first broadcast, as a command, to the other ranks, which run :func:`follow` until told to stop.
Commands travel on a gloo group of their own, on the CPU, whatever the data-parallel backend is. A rank that
fails exits; torchrun then stops the others, and the job resumes from its last checkpoint as one process
would.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamrft.schemas import Experience

from .engine import TrainingEngine

logger = logging.getLogger(__name__)

# Rank 0 may wait for experiences for hours (a slow explorer, a paused run) while the others wait for its next
# command; a dead rank is torchrun's to notice, so the command group never times out by itself.
COMMAND_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (or a launcher setting the same variables) started as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_ranks(device: str = "auto") -> RankInfo:
    """Join the default process group from torchrun's environment: NCCL on CUDA (one GPU per local rank), gloo
    on the CPU. ``device``: ``auto``, ``cpu`` or ``cuda``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=target if use_cuda else None)
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, target)


class CommandChannel:
    """Rank 0 broadcasts ``(command, args)``; the other ranks receive them in order."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)

    def send(self, command: str, *args: Any) -> None:
        dist.broadcast_object_list([(command, args)], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple]:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=self.group)
        return message[0]


class RankZeroEngine:
    """Rank 0's handle on the engine of every rank: what the trainer calls, run in step on all of them.

    Only whole operations are offered (a step, not its stages): a stage run on rank 0 alone would leave the
    other ranks out of its collectives.
    """

    def __init__(self, engine: TrainingEngine, channel: CommandChannel) -> None:
        self.engine = engine
        self.channel = channel

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def settings(self):
        return self.engine.settings

    @property
    def step(self) -> int:
        return self.engine.step

    @property
    def lr(self) -> float:
        return self.engine.lr

    @property
    def world_size(self) -> int:
        return self.engine.parallel.world_size

    def train_step(self, experiences: Sequence[Experience],
                   needs_correction: Sequence[bool] | None = None) -> dict[str, float]:
        experiences = list(experiences)
        flags = None if needs_correction is None else list(needs_correction)
        self.channel.send("train_step", experiences, flags)
        return self.engine.train_step(experiences, needs_correction=flags)

    def save_state(self, directory: str | Path) -> None:
        self.channel.send("save_state", str(directory))
        self.engine.save_state(directory)

    def load_state(self, directory: str | Path) -> None:
        self.channel.send("load_state", str(directory))
        self.engine.load_state(directory)

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole weights, one tensor at a time; the other ranks gather alongside. Iterate to the end."""
        self.channel.send("named_weights", dtype)
        yield from self.engine.named_weights(dtype)

    def publish_metadata(self) -> dict[str, str]:
        return self.engine.publish_metadata()

    def stop_followers(self) -> None:
        self.channel.send("stop")


def follow(engine: TrainingEngine, channel: CommandChannel) -> int:
    """The loop of every rank but 0: run rank 0's commands until it says stop. Returns the commands run."""
    count = 0
    while True:
        command, args = channel.receive()
        if command == "stop":
            logger.info("rank %d: stopped by rank 0 after %d command(s)", dist.get_rank(), count)
            return count
        if command == "named_weights":
            for _ in engine.named_weights(*args):
                pass  # this rank's part is the gather itself
        elif command in ("train_step", "save_state", "load_state"):
            getattr(engine, command)(*args)
        else:
            raise RuntimeError(f"rank {dist.get_rank()}: unknown command {command!r} from rank 0")
        count += 1
