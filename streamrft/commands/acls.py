"""``streamrft acls RUN.yaml``: the principals of a run's roles and the ACLs each needs (``streamrft/acls.py``);
``--apply`` creates the ACLs, ``--create-users DIR`` also the SCRAM users, with their credentials files in DIR.
Both need the cluster's admin as the config's principal (an embedded broker with security on is reached as its
admin)."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..acls import run_acls
from ..errors import StreamrftError
from .common import add_config_argument, config_from, console, open_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("acls", help="the principal of each role of a run and the ACLs it needs; "
                                                "--apply creates them")
    add_config_argument(parser, positional=True)
    parser.add_argument("--format", choices=("table", "kafka-acls"), default="table",
                        help="a table, or the equivalent kafka-acls commands")
    parser.add_argument("--apply", action="store_true", help="create the ACLs on the run's cluster (as its admin)")
    parser.add_argument("--create-users", metavar="DIR", default=None,
                        help="with --apply: also create a SCRAM-SHA-512 user per role (random password) and write "
                             "its credentials file (mode 0600) to DIR, for kafka.credentials_file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    acls = run_acls(config)
    if args.format == "kafka-acls":
        print("\n".join(acl.kafka_acls_command() for role_acls in acls.values() for acl in role_acls))
    else:
        table = Table(title=f"run {config.name}: one principal per role, ALLOW from any host")
        for column in ("principal", "operation", "resource", "pattern", "name"):
            table.add_column(column)
        for role_acls in acls.values():
            for acl in role_acls:
                table.add_row(acl.principal, acl.operation.upper(), acl.resource, acl.pattern, acl.name)
        Console().print(table)
    if args.create_users and not args.apply:
        raise StreamrftError("--create-users goes with --apply")
    if args.apply:
        _apply(config, args.create_users)
    return 0


def _apply(config, users_dir: str | None) -> None:
    from ..kafka.security import AdminRefused, create_acls
    from ..principals import provision

    with open_run(config, create_topics=True) as clients:
        try:
            if users_dir:
                files = provision(clients, Path(users_dir))
                console.print(f"created {len(files)} users; credentials files (mode 0600) in {users_dir}")
            else:
                count = create_acls(clients.admin(), [acl for acls in run_acls(config).values() for acl in acls])
                console.print(f"created {count} ACLs")
        except AdminRefused as exc:
            raise StreamrftError(f"{exc}; run `streamrft acls --apply` with the admin's credentials "
                                 "(kafka.sasl_username / kafka.credentials_file)") from None
