"""What the explorer reads again when it goes on from a state record (at start, or after a unit that could not
commit): ``results`` from where the oldest round in flight's results begin, and the past results that the task
orders which learn from them are rebuilt from."""
from __future__ import annotations

import logging

from streamrft.config import RunConfig
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Offsets
from streamrft.schemas import RolloutResult

logger = logging.getLogger(__name__)


def results_start(config: RunConfig, clients: KafkaClients, in_flight: list[dict]) -> Offsets:
    """Per partition of ``results``: where the oldest round in flight's results begin, or the end (from now)."""
    offsets = clients.offsets(config.topic("results"), "end")
    for (topic, partition) in offsets:
        saved = [int(e["results_offsets"][str(partition)]) for e in in_flight
                 if str(partition) in e.get("results_offsets", {})]
        if saved:
            offsets[(topic, partition)] = min(saved)
    return offsets


def replay_results(config: RunConfig, clients: KafkaClients, tasks) -> None:
    """Every past result to ``tasks.observe`` (the task orders that learn from results)."""
    from streamrft.kafka.reader import read_topic

    topic = config.topic("results")
    count = 0
    for raw in read_topic(config.kafka, clients.bootstrap, topic, idle_timeout=1.0):
        try:
            tasks.observe(clients.serde.decode(raw.value, topic, RolloutResult))
            count += 1
        except Exception:  # undecodable history is the DLQ's business, not the selector's
            continue
    logger.info("explorer: the task orders that learn from results rebuilt from %d past results", count)
