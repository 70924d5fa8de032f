"""The ``streamrft`` command line. Each subcommand lives in ``streamrft/commands/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the parsed args and
returning an exit code."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import StreamrftError
from .logs import configure_logging

logger = logging.getLogger(__name__)

# Order is the order of `streamrft --help`.
COMMAND_MODULES = (
    "broker",
    "topics",
    "acls",
    "tasks",
    "data",
    "tail",
    "model",
    "roles",
    "run",
    "report",
    "k8s",
    "serve",
    "bench",
    "export",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrft",
        description="Reinforcement fine-tuning of language models on Apache Kafka.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"streamrft.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"streamrft.commands.{name}":
                raise
            continue  # command not built yet in this checkout
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except StreamrftError as exc:
        # Expected, explained failures (bad config, missing Java, ...): the message says how to fix it.
        logger.debug("failed", exc_info=True)
        print(f"streamrft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
