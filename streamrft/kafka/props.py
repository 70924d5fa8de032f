"""librdkafka properties for each kind of client.

Precedence, lowest to highest: our defaults < the user's ``kafka.producer/consumer/admin`` extras < connection
settings < the guarantees the client layer depends on (idempotence, acks, manual commits, read_committed),
which no extra may weaken.
"""
from __future__ import annotations

import logging

from ..config import KafkaConfig

# Experiences can be large (long sequences, logprobs); the embedded broker accepts 16 MiB messages.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_librdkafka_logger = logging.getLogger("streamrft.kafka.librdkafka")


def _merge(*layers: dict) -> dict:
    out: dict = {}
    for layer in layers:
        out.update({k: v for k, v in layer.items() if v is not None})
    return out


def producer_props(kafka: KafkaConfig, bootstrap: str, transactional_id: str | None = None,
                   client_id: str = "streamrft") -> dict:
    defaults = {"linger.ms": 5, "message.max.bytes": MAX_MESSAGE_BYTES, "client.id": client_id,
                "logger": _librdkafka_logger}
    # delivery.report.only.error: successful deliveries cost no Python callback; failures are still reported
    # (and raised at flush), which is all the producer wrapper needs.
    guarantees = {"enable.idempotence": True, "acks": "all", "delivery.report.only.error": True}
    if transactional_id:
        guarantees["transactional.id"] = transactional_id
    return _merge(defaults, kafka.producer, kafka.client_properties(bootstrap), guarantees)


def consumer_props(kafka: KafkaConfig, bootstrap: str, group_id: str, client_id: str = "streamrft",
                   read_committed: bool = True, auto_offset_reset: str = "earliest") -> dict:
    defaults = {
        "client.id": client_id,
        "auto.offset.reset": auto_offset_reset,
        # fetch.max.bytes / max.partition.fetch.bytes keep librdkafka's defaults (50 MB / 1 MB): a record larger
        # than them is still fetched (the broker always returns the first batch), and small fetches keep the
        # prefetch queue flowing. 64 MB fetches made the consumer stall on each one: the data-plane benchmark
        # read Experience records at 0.62 of raw throughput with them and at 0.94 without.
        # Role loops can spend minutes in one generation or training step between polls.
        "max.poll.interval.ms": 900_000,
        # A killed member's partitions move to the others after this long (the broker's minimum is 6 s).
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 2_000,
        "logger": _librdkafka_logger,
    }
    guarantees = {
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed" if read_committed else "read_uncommitted",
    }
    return _merge(defaults, kafka.consumer, kafka.client_properties(bootstrap), guarantees)


def admin_props(kafka: KafkaConfig, bootstrap: str) -> dict:
    return _merge({"logger": _librdkafka_logger}, kafka.admin, kafka.client_properties(bootstrap))
