"""``streamrft topics``: a run's topics with partitions, end offsets and each consumer group's lag in records (what
a read_committed reader of the group has yet to get: transaction markers take offsets and are no records)."""
from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from .common import add_config_argument, config_from, open_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("topics", help="show a run's topics, end offsets and consumer-group lag (records)")
    add_config_argument(parser)
    parser.add_argument("--create", action="store_true", help="create the run's topics if they are missing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    with open_run(config, create_topics=args.create) as clients:
        reports = clients.describe()
    table = Table(title=f"run {config.name} (prefix {config.topic_prefix})")
    for column in ("topic", "partitions", "end offsets (sum)", "group lag (records)"):
        table.add_column(column, justify="right" if column != "topic" else "left")
    for report in reports:
        lag = ", ".join(f"{group}: {lag}{'' if report.exact.get(group, True) else ' or fewer'}"
                        for group, lag in sorted(report.groups.items())) or "-"
        table.add_row(report.name, str(report.partitions), str(report.end_offsets_total), lag)
    if not reports:
        table.caption = "no topics yet: `streamrft topics --create` or produce tasks first"
    Console().print(table)
    return 0
