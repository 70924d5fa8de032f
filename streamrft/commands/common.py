"""What every command shares: the --config option, loading it, and opening the run's Kafka clients."""
from __future__ import annotations

import argparse
import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from rich.console import Console

from ..errors import BrokerError

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..kafka import KafkaClients

# The run config and the Kafka clients are imported where a command runs, not when its parser is built: `--help`
# pays for neither.

console = Console(stderr=True)
logger = logging.getLogger(__name__)


def add_config_argument(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    help_text = "run configuration (YAML); defaults + STREAMRFT_* environment variables when omitted"
    if positional:
        parser.add_argument("config", metavar="CONFIG", help=help_text)
    else:
        parser.add_argument("-c", "--config", metavar="CONFIG", default=None, help=help_text)


def config_from(args: argparse.Namespace) -> "RunConfig":
    from ..config import load_config

    return load_config(getattr(args, "config", None))


@contextmanager
def open_run(config: "RunConfig", create_topics: bool = True, shared_broker: bool = False
             ) -> Iterator["KafkaClients"]:
    """Kafka clients for the run on its cluster (the embedded broker when none is configured), with the
    run's topics created if missing. ``shared_broker``: a role process must meet the other roles on one
    cluster, so it never starts a private embedded broker."""
    from ..broker import cluster_for, running_broker
    from ..kafka import KafkaClients

    if shared_broker and config.kafka.embedded and running_broker() is None:
        raise BrokerError(
            "this role needs the cluster the other roles use: set kafka.bootstrap_servers (or "
            "STREAMRFT_KAFKA__BOOTSTRAP_SERVERS), start a shared broker with `streamrft broker start`, or use "
            "`streamrft run CONFIG`, which starts everything")
    with cluster_for(config) as on_cluster:
        clients = KafkaClients(on_cluster, on_cluster.kafka.bootstrap_servers)
        try:
            if on_cluster.kafka.authenticated:
                clients.check_credentials()
                kafka = on_cluster.kafka
                logger.info("connected to %s as User:%s (%s, %s)", kafka.bootstrap_servers, kafka.sasl_username,
                            kafka.security_protocol, kafka.sasl_mechanism)
            if create_topics and not _role_principal(on_cluster):
                clients.ensure_topics()
            yield clients
        finally:
            clients.close()


def _role_principal(config: "RunConfig") -> bool:
    """Whether the config's principal is one of a run's roles: those may not create topics (their ACLs allow
    only their own work); the run's admin creates them (`streamrft run`, `streamrft topics --create`)."""
    from ..acls import ROLES, principal_name

    return config.kafka.sasl_username in {principal_name(config, role) for role in ROLES}
