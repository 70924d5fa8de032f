"""The ``streamrft`` command line. Each subcommand lives in ``streamrft/commands/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the parsed args and
returning an exit code.

Only the module of the command asked for is imported (``streamrft --help`` and a mistyped command import them
all, to list them): a command pays for what it uses, not for every other command's imports."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import OPERATOR_EXIT, OperatorNeeded, StreamrftError
from .logs import configure_logging

logger = logging.getLogger(__name__)

# Order is the order of `streamrft --help`.
COMMAND_MODULES = (
    "broker",
    "registry",
    "topics",
    "acls",
    "tasks",
    "data",
    "tail",
    "schemas",
    "model",
    "roles",
    "run",
    "report",
    "k8s",
    "serve",
    "bench",
    "export",
    "s3",
    "ui",
)


def build_parser(commands: tuple[str, ...] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """The parser with the subcommands ``commands`` (all by default)."""
    parser = argparse.ArgumentParser(
        prog="streamrft",
        description="Reinforcement fine-tuning of language models on Apache Kafka.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in commands:
        try:
            module = importlib.import_module(f"streamrft.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"streamrft.commands.{name}":
                raise
            continue  # command not built yet in this checkout
        module.register(subparsers)
    return parser


def _asked_for(argv: list[str]) -> tuple[str, ...]:
    """The command named by ``argv`` (its first word that is not an option), alone; every command otherwise."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return (first,) if first in COMMAND_MODULES else COMMAND_MODULES


def main(argv: list[str] | None = None) -> int:
    owns_process = argv is None  # run from the command line: the process is the command's alone
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_asked_for(argv)).parse_args(argv)
    args.owns_process = owns_process
    configure_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except OperatorNeeded as exc:  # not a crash: `streamrft run` leaves it stopped (launch/supervision.py)
        print(f"streamrft: stopped: {exc}", file=sys.stderr)
        return OPERATOR_EXIT
    except StreamrftError as exc:
        # Expected, explained failures (bad config, missing Java, ...): the message says how to fix it.
        logger.debug("failed", exc_info=True)
        print(f"streamrft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
