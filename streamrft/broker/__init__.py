"""The embedded single-node KRaft Apache Kafka broker, and ``kafka_for``: where a command finds its Kafka."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from .jars import ensure_jars
from .server import EmbeddedBroker
from .state import running_broker

if TYPE_CHECKING:
    from ..config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedBroker", "ensure_jars", "kafka_for", "running_broker"]


@contextmanager
def kafka_for(config: "RunConfig") -> Iterator[str]:
    """Bootstrap servers for a run, in order of preference: the configured cluster; a broker left running by
    `streamrft broker start`; else an embedded broker that lives as long as the ``with`` block."""
    if not config.kafka.embedded:
        yield config.kafka.bootstrap_servers
        return
    state = running_broker()
    if state is not None:
        logger.debug("using the broker started by `streamrft broker start` at %s", state.bootstrap_servers)
        yield state.bootstrap_servers
        return
    with EmbeddedBroker(config.broker) as broker:
        yield broker.bootstrap_servers
