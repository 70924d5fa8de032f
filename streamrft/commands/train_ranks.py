"""``streamrft train`` as a torch.distributed job: ``trainer.nproc`` processes on this machine (torchrun
``--standalone``), or ``torchrun --nnodes ... -m streamrft.cli train RUN.yaml`` started on each machine.

Every rank loads the model and wraps it for ``trainer.parallel`` (FSDP2 or DDP). Rank 0 is the trainer role
(Kafka, checkpoints, publishing); the others follow its commands (:mod:`streamrft.engines.training.ranks`
says why, and how exactly-once is kept).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch.distributed as dist

from ..config import RunConfig
from streamrft.engines.training.ranks import (
    CommandChannel,
    RankZeroEngine,
    follow,
    init_ranks,
    launched_by_torchrun,
)
from ..lifecycle import StopSignal, exit_with_launcher
from .common import open_run

__all__ = ["launched_by_torchrun", "relaunch_under_torchrun", "run_trainer_ranks"]

logger = logging.getLogger(__name__)


def relaunch_under_torchrun(nproc: int) -> None:
    """Replace this process by torchrun starting ``nproc`` ranks of the same command (same pid, so a launcher's
    signals and parent-death signal still reach it)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "streamrft.cli", *sys.argv[1:]]
    logger.info("trainer.nproc=%d: starting the trainer's ranks with torchrun", nproc)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def run_trainer_ranks(args: argparse.Namespace, config: RunConfig) -> int:
    from streamrft.consumers.trainer import build_engine
    from streamrft.engines.training.parallel import strategy

    exit_with_launcher()
    info = init_ranks(config.trainer.device)
    parallel = strategy(config.trainer.parallel)
    logger.info("trainer rank %d of %d on %s (%s)", info.rank, info.world_size, info.device, parallel.name)
    engine = build_engine(config, parallel, device=info.device)
    channel = CommandChannel()
    # Signals are rank 0's to act on: it finishes the step, checkpoints (with every rank, under FSDP), then
    # stops the others; a rank that left at the signal would leave that checkpoint without its shard.
    with StopSignal() as stop:
        if info.rank == 0:
            _run_rank_zero(args, config, RankZeroEngine(engine, channel), stop)
        else:
            follow(engine, channel)
    dist.destroy_process_group()
    return 0


def _run_rank_zero(args: argparse.Namespace, config: RunConfig, ranked: RankZeroEngine, stop: StopSignal) -> None:
    from streamrft.consumers.trainer import Trainer

    with open_run(config, shared_broker=True) as clients:
        trainer = Trainer(config, clients, stop, group=args.group, replay_from=args.replay_from,
                          accept_offset_reset=args.accept_offset_reset, engine=ranked)
        try:
            trainer.run()
        finally:
            trainer.close()
    # only after a clean finish: after a failure the other ranks may be inside a collective; torchrun stops
    # them when this rank exits
    ranked.stop_followers()
