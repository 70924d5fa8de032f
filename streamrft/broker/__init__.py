"""The embedded KRaft Apache Kafka broker (one node, or a replicated cluster of ``broker.nodes``), and
``kafka_for``: where a command finds its Kafka."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .jars import ensure_jars
from ..credentials import read_credential
from ..errors import ConfigError
from .security import ADMIN_FILE, SECURITY_DIR
from .server import EmbeddedBroker
from .state import running_broker

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..credentials import Credential

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedBroker", "admin_credential", "check_replication", "cluster_for", "ensure_jars", "kafka_for",
           "running_broker"]


@contextmanager
def kafka_for(config: "RunConfig") -> Iterator[str]:
    """Bootstrap servers for a run (see :func:`cluster_for`)."""
    with cluster_for(config) as on_cluster:
        yield on_cluster.kafka.bootstrap_servers


@contextmanager
def cluster_for(config: "RunConfig") -> Iterator["RunConfig"]:
    """``config`` pointed at its cluster, in order of preference: the configured cluster; a broker left running
    by `streamrft broker start`; else an embedded broker that lives as long as the ``with`` block. An embedded
    broker with security on is reached as its admin, unless the config names a principal of its own."""
    if not config.kafka.embedded:
        yield config
        return
    state = running_broker()
    if state is not None:
        logger.debug("using the broker started by `streamrft broker start` at %s", state.bootstrap_servers)
        check_replication(config, state.nodes)
        yield config.on_cluster(state.bootstrap_servers, admin_credential(Path(state.data_dir)))
        return
    check_replication(config, config.broker.nodes)
    with EmbeddedBroker(config.broker) as broker:
        yield config.on_cluster(broker.bootstrap_servers, broker.security.admin if broker.security else None)


def check_replication(config: "RunConfig", nodes: int) -> None:
    """Refuse, before anything starts, topics that ask for more replicas than the embedded broker has nodes
    (Kafka would refuse them at creation, after the broker's start, with a message about registered brokers)."""
    wanted = {name: layout.replication_factor for name, layout in config.topic_layouts().items()
              if layout.replication_factor > nodes}
    if wanted:
        name, factor = next(iter(wanted.items()))
        raise ConfigError(f"topic {name} asks for replication_factor {factor} and the embedded broker has {nodes} "
                          f"node(s): set broker.nodes to 3, or leave the topics' replication_factor at -1 (the "
                          f"embedded broker's default, min(3, nodes))")


def admin_credential(data_dir: Path) -> "Credential | None":
    """The admin of the broker whose data is in ``data_dir`` when it runs with security on, else None."""
    path = data_dir / SECURITY_DIR / ADMIN_FILE
    return read_credential(path) if path.exists() else None
