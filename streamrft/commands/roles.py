"""``streamrft explorer|rollout|train|monitor CONFIG``: one role per process, to spread a run over machines
that share one Kafka cluster. Rollout workers can be added at any time; they join the consumer group."""
from __future__ import annotations

import argparse
import logging

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


def run_explorer(args: argparse.Namespace) -> int:
    from ..consumers.explorer import Explorer

    config = config_from(args)
    with open_run(config, shared_broker=True) as clients, StopSignal() as stop:
        explorer = Explorer(config, clients, stop)
        try:
            state = explorer.run()
        finally:
            explorer.close()
    return 0 if state.done or stop.requested else 1


def run_rollout(args: argparse.Namespace) -> int:
    from ..consumers.rollout import RolloutWorker

    config = config_from(args)
    with open_run(config, shared_broker=True) as clients, StopSignal() as stop:
        worker = RolloutWorker(config, clients, stop, worker_id=args.worker_id)
        try:
            worker.run(max_requests=args.max_requests)
        finally:
            worker.close()
    return 0
