"""The Kafka client layer: with ``streamrft.broker``, the only part of streamrft that imports ``confluent_kafka``.

``KafkaClients`` builds every client of a run from its config, so role code never assembles librdkafka
properties itself.
"""
from __future__ import annotations

import logging
import os
import time
import uuid

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from streamrft.schemas import Record
from ..config import KafkaConfig, RunConfig
from .admin import committed_offsets, describe_run, ensure_topics, group_lag, run_topics, watermarks
from .authorization import authentication_failed, is_authentication_failure, is_refusal, refusal_for
from .consumer import Check, Checks, Delivered, RecordConsumer
from .reader import read_to_end
from .records_lag import Counted, count_records
from .dlq import DeadLetter, DeadLetterLedger, dead_letter, dlq_topic_of
from .producer import DeliveryError, RecordProducer
from .props import admin_props, consumer_props, producer_props
from .serde import Serde
from .transaction import FatalTransactionError, MembershipLost, TransactionFailed, Transactor
from .unanswered import unanswered

logger = logging.getLogger(__name__)

__all__ = [
    "KafkaClients", "unanswered", "Delivered", "RecordConsumer", "RecordProducer", "DeliveryError", "DeadLetter",
    "dead_letter", "dlq_topic_of", "Serde", "Transactor", "TransactionFailed", "MembershipLost",
    "FatalTransactionError", "DeadLetterLedger",
]


def check_credentials(kafka: KafkaConfig, bootstrap: str, timeout: float = 20.0, settle_s: float = 0.0) -> None:
    """Connect with ``kafka``'s credentials; AuthenticationError (without the secret) when they are refused.
    librdkafka reports the refusal on its error callback, while the metadata request itself only fails as a
    transport error. ``settle_s``: refusals in the first seconds are tried again (users just created reach the
    broker's credential cache a moment after the admin API returns)."""
    refused: list[KafkaError] = []

    def on_error(error: KafkaError) -> None:
        if is_authentication_failure(error):
            refused.append(error)

    admin = AdminClient({**admin_props(kafka, bootstrap), "error_cb": on_error})
    started = time.monotonic()
    deadline = started + timeout
    while True:
        try:
            admin.list_topics(timeout=max(0.5, min(2.0, deadline - time.monotonic())))
            return
        except KafkaException as exc:
            admin.poll(0.1)  # serves the error callback
            error = refused[0] if refused else exc.args[0]
            settling = time.monotonic() - started < settle_s
            if is_authentication_failure(error) and not settling:
                raise authentication_failed(kafka, error) from None
            if time.monotonic() > deadline:
                raise
            refused.clear()


class KafkaClients:
    """Factory of producers, consumers and admin clients for one run on one cluster."""

    def __init__(self, config: RunConfig, bootstrap: str):
        self.config = config
        self.bootstrap = bootstrap
        self.serde = Serde(config.schema_registry)
        self.refuse = refusal_for(config)
        self._admin: AdminClient | None = None
        self._probe: Consumer | None = None
        self._readers: dict[str, Consumer] = {}

    def check_credentials(self, timeout: float = 20.0) -> None:
        """Fail at start, with a clear message, when the cluster refuses the configured credentials (a wrong
        SASL password) rather than in the first poll of a role."""
        check_credentials(self.config.kafka, self.bootstrap, timeout)

    def producer(self, transactional_id: str | None = None, client_id: str = "streamrft",
                 extra: dict | None = None) -> RecordProducer:
        props = producer_props(self.config.kafka, self.bootstrap, transactional_id, client_id) | (extra or {})
        return RecordProducer(props, self.serde, self.refuse)

    def consumer(self, topics: list[str], record_type: type[Record], group: str, *, client_id: str = "streamrft",
                 read_committed: bool = True, subscribe: bool = True, auto_offset_reset: str = "earliest",
                 dead_letters: bool = True, check: Checks | None = None, max_record_bytes: int | None = None,
                 on_dead_letter=None, extra: dict | None = None) -> RecordConsumer:
        """A consumer of ``record_type`` in consumer group ``group``. Every record is checked where it is read
        (see ``RecordConsumer``); bad ones go to ``<topic>.dlq`` through a producer of its own, once per group:
        the letters this group already sent are read back from the DLQ topics first. ``dead_letters=False``:
        bad records are skipped, another reader owns their letters."""
        props = consumer_props(self.config.kafka, self.bootstrap, group, client_id, read_committed,
                               auto_offset_reset) | (extra or {})
        dlq = ledger = None
        if dead_letters:
            dlq = self.producer(client_id=f"{client_id}-dlq")
            ledger = self.dead_letter_ledger(group, *topics)
        return RecordConsumer(props, self.serde, topics, record_type, dlq, subscribe, check=check, ledger=ledger,
                              max_record_bytes=max_record_bytes, on_dead_letter=on_dead_letter, refuse=self.refuse)

    def dead_letter_ledger(self, group: str, *topics: str) -> DeadLetterLedger:
        """What ``group`` already dead-lettered from ``topics``, read back from their DLQ topics."""
        return DeadLetterLedger.from_letters(group, (raw for topic in topics for raw in
                                                     read_to_end(self.config.kafka, self.bootstrap,
                                                                 dlq_topic_of(topic))))

    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(admin_props(self.config.kafka, self.bootstrap))
        return self._admin

    def probe(self) -> Consumer:
        """A group-less consumer for offset look-ups (watermarks, offsets for times)."""
        if self._probe is None:
            props = consumer_props(self.config.kafka, self.bootstrap, f"streamrft-probe-{uuid.uuid4().hex[:8]}",
                                   f"probe-{os.getpid()}")
            self._probe = Consumer(props)
        return self._probe

    def offsets_reader(self, group: str) -> Consumer:
        """A consumer with ``group``'s id that never joins it, to read its committed offsets (see kafka/admin.py
        for why not the admin API)."""
        if group not in self._readers:
            props = consumer_props(self.config.kafka, self.bootstrap, group, f"offsets-{os.getpid()}")
            self._readers[group] = Consumer(props)
        return self._readers[group]

    def offsets(self, topic: str, which: str = "end") -> dict[tuple[str, int], int]:
        """First (``which="start"``) or next-to-be-written (``"end"``) offset of every partition of ``topic``."""
        metadata = self.admin().list_topics(topic, timeout=10).topics.get(topic)
        if metadata is not None and metadata.error is not None and is_refusal(metadata.error):
            raise self.refuse(metadata.error, "describe", topic)
        if metadata is None or metadata.error is not None:
            raise KeyError(f"topic {topic} does not exist; create the run's topics first (streamrft topics --create)")
        index = 0 if which == "start" else 1
        return {(topic, p): watermarks(self.probe(), TopicPartition(topic, p))[index] for p in metadata.partitions}

    def committed(self, group: str, topic: str) -> dict[tuple[str, int], int]:
        """Committed next-offsets of ``group`` on ``topic``; partitions without a commit are left out."""
        return committed_offsets(self.admin(), self.offsets_reader(group), topic)

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[tuple[str, int], int]:
        """Per partition of ``topic``, the first offset whose record timestamp is >= ``timestamp_ms`` (the end
        offset where no record is that recent)."""
        ends = self.offsets(topic, "end")
        found = self.probe().offsets_for_times([TopicPartition(t, p, timestamp_ms) for (t, p) in ends],
                                               timeout=10)
        out = {}
        for tp in found:
            if tp.error is not None:
                raise KafkaException(tp.error)
            out[(tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else ends[(tp.topic, tp.partition)]
        return out

    def ensure_topics(self) -> list[str]:
        return ensure_topics(self.admin(), run_topics(self.config))

    def describe(self):
        """The run's topics: partitions, end offsets and each of the run's consumer groups' lag in records."""
        topics = list(run_topics(self.config))
        return describe_run(self.admin(), self.probe(), self.offsets_reader, topics, f"{self.config.name}.",
                            self.count_records)

    def count_records(self, spans: dict[tuple[str, int], tuple[int, int]]) -> dict[tuple[str, int], Counted]:
        """Per partition, the records a read_committed reader gets between two offsets (``records_lag.py``)."""
        return count_records(self.config.kafka, self.bootstrap, spans)

    def lag(self, group: str, topic: str) -> int | None:
        """Total lag of ``group`` on ``topic`` in offsets (records, markers and aborted records: an upper bound
        of the records, cheap enough to ask many times a second; ``describe`` counts records), or None while the
        cluster does not answer (a broker restart): callers that pace on it wait, rather than stop."""
        try:
            return group_lag(self.admin(), self.probe(), self.offsets_reader(group), topic)
        except KafkaException as exc:
            error = exc.args[0]
            if is_refusal(error):
                raise self.refuse(error, "describe", group) from None
            if not unanswered(exc):
                raise
            logger.warning("lag of %s on %s unknown for now: %s", group, topic, error.str())
            return None

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
