"""``streamrft explorer|rollout|train|monitor CONFIG``: one role per process, to spread a run over machines
that share one Kafka cluster. Rollout workers can be added at any time; they join the consumer group."""
from __future__ import annotations

import argparse
import logging

from ..errors import ConfigError
from ..lifecycle import StopSignal
from .common import add_config_argument, config_from, open_run

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    explorer = subparsers.add_parser("explorer", help="run the explorer of a run")
    add_config_argument(explorer, positional=True)
    explorer.set_defaults(func=run_explorer)

    rollout = subparsers.add_parser("rollout", help="run one rollout worker (start several to scale out)")
    add_config_argument(rollout, positional=True)
    rollout.add_argument("--worker-id", default=None, help="stable id (default: host-pid-random)")
    rollout.add_argument("--max-requests", type=int, default=None, help="stop after this many requests")
    rollout.set_defaults(func=run_rollout)

    train = subparsers.add_parser("train", help="run the trainer of a run (resumes from its newest checkpoint)")
    add_config_argument(train, positional=True)
    train.add_argument("--replay-from", metavar="OFFSET|TIME", default=None,
                       help="start a new lineage from this offset (every partition), epoch milliseconds or ISO "
                            "8601 time (UTC unless a zone is given), or 'earliest', instead of the checkpoint / "
                            "committed offsets")
    train.add_argument("--group", metavar="NAME", default=None,
                       help="train as consumer group <run>.trainer-NAME with checkpoints in <checkpoint_dir>-NAME: a "
                            "second trainer on the same stream that leaves the main one (and the workers' weights) "
                            "alone")
    train.add_argument("--accept-offset-reset", action="store_true",
                       help="when someone else reset the trainer's consumer group (kafka-consumer-groups "
                            "--reset-offsets), read on from the group's offsets with this lineage's weights instead of "
                            "stopping (at start and while running)")
    train.set_defaults(func=run_train)

    monitor = subparsers.add_parser("monitor", help="export the run's metrics: Prometheus, TensorBoard, CSV")
    add_config_argument(monitor, positional=True)
    monitor.add_argument("--max-idle-s", type=float, default=None,
                         help="stop once no metric came for this long (default: run until stopped)")
    monitor.add_argument("--prometheus-config", metavar="FILE", default=None,
                         help="write a Prometheus scrape config for the run's roles' /metrics to FILE ('-': stdout) "
                              "and exit, instead of running the monitor")
    monitor.set_defaults(func=run_monitor)


def _run_role(args: argparse.Namespace, build, run, config=None) -> int:
    """Load the config (unless given), open the shared cluster, build the role, run it until done or stopped,
    close it. ``build(config, clients, stop)`` makes the role; ``run(role)`` returns the exit code."""
    config = config or config_from(args)
    with open_run(config, shared_broker=True) as clients, StopSignal() as stop:
        role = build(config, clients, stop)
        try:
            return run(role) if not stop.requested else 0
        finally:
            role.close()


def run_explorer(args: argparse.Namespace) -> int:
    from streamrft.consumers.explorer import Explorer

    def run(explorer) -> int:
        state = explorer.run()
        return 0 if state.done or explorer.stop.requested else 1

    config = config_from(args)
    if not config.shape.has_explorer:
        raise ConfigError(f"mode is {config.mode}: this run has no explorer (its trainer trains supervised data "
                          "alone); set mode: both to roll out tasks")
    return _run_role(args, Explorer, run, config)


def run_rollout(args: argparse.Namespace) -> int:
    from streamrft.consumers.rollout import RolloutWorker

    def build(config, clients, stop):
        return RolloutWorker(config, clients, stop, worker_id=args.worker_id)

    def run(worker) -> int:
        worker.run(max_requests=args.max_requests)
        return 0

    return _run_role(args, build, run)


def run_train(args: argparse.Namespace) -> int:
    """The trainer; with ``trainer.nproc`` > 1 this command re-executes itself under torchrun, and each rank
    comes back here (see :mod:`streamrft.commands.train_ranks`)."""
    from .train_ranks import launched_by_torchrun, relaunch_under_torchrun, run_trainer_ranks

    config = config_from(args)
    if launched_by_torchrun():
        return run_trainer_ranks(args, config)
    if config.trainer.nproc > 1:
        relaunch_under_torchrun(config.trainer.nproc)  # does not return

    from streamrft.consumers.trainer import Trainer

    def build(config, clients, stop):
        return Trainer(config, clients, stop, group=args.group, replay_from=args.replay_from,
                       accept_offset_reset=args.accept_offset_reset)

    def run(trainer) -> int:
        trainer.run()
        return 0

    return _run_role(args, build, run, config)


def run_monitor(args: argparse.Namespace) -> int:
    if args.prometheus_config is not None:
        return write_prometheus_config(args)
    from streamrft.consumers.monitor import Monitor
    from streamrft.runtime.allocator import fix_mmap_threshold

    if getattr(args, "owns_process", False):  # not when called in another program's process (a test's)
        fix_mmap_threshold()  # the monitor runs as long as the run and holds no tensors (the module says why)

    def run(monitor) -> int:
        monitor.run(max_idle_s=args.max_idle_s)
        return 0

    return _run_role(args, Monitor, run)


def write_prometheus_config(args: argparse.Namespace) -> int:
    """``--prometheus-config FILE``: the scrape config of :mod:`streamrft.scrape_config`, no cluster needed."""
    import sys
    from pathlib import Path

    import yaml

    from ..scrape_config import scrape_config

    config = config_from(args)
    text = f"# Prometheus scrape config for run {config.name} (streamrft monitor --prometheus-config)\n"
    text += yaml.safe_dump(scrape_config(config), sort_keys=False)
    if args.prometheus_config == "-":
        sys.stdout.write(text)
    else:
        Path(args.prometheus_config).write_text(text)
        logger.info("monitor: scrape config written to %s (prometheus --config.file=%s)", args.prometheus_config,
                    args.prometheus_config)
    return 0
