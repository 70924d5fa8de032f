"""Topic administration: idempotent creation of a run's topics, and a read-out of offsets and group lag.

A group's committed offsets are read by a consumer that carries the group's id and never joins it (an *offsets
reader*), not by the admin API's list_consumer_group_offsets: librdkafka (2.16) aborts or crashes the whole
process when the group's coordinator goes away while that admin request is in flight (a use-after-free in its
coordinator requests, librdkafka PR #5397; reproduced here on the 3-node embedded cluster, 1st SIGKILL of the
coordinator), which took the explorer down in a chaos run. The consumer's own OffsetFetch rides out the same
failover: 30,000 look-ups through 3 coordinator kills, none lost but the ones that timed out."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from ..config import RunConfig, TopicConfig
from .records_lag import Counted

logger = logging.getLogger(__name__)

# group -> its offsets reader (a Consumer with that group.id that never subscribes; see the module docstring)
OffsetsReaders = Callable[[str], Consumer]


def run_topics(config: RunConfig) -> dict[str, TopicConfig]:
    """Every topic of a run (full name -> layout): the six data topics and their dead-letter topics."""
    return config.topic_layouts()


def ensure_topics(admin: AdminClient, topics: dict[str, TopicConfig], timeout: float = 30.0) -> list[str]:
    """Create the topics that do not exist yet; existing ones are left alone (a second call is a no-op).
    Returns the names created."""
    existing = set(admin.list_topics(timeout=timeout).topics)
    missing = [
        NewTopic(name, num_partitions=layout.partitions, replication_factor=layout.replication_factor,
                 config=layout.kafka_config())
        for name, layout in topics.items() if name not in existing
    ]
    created = []
    for name, future in (admin.create_topics(missing, request_timeout=timeout).items() if missing else []):
        try:
            future.result()
            created.append(name)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:  # another role created it concurrently
                raise KafkaException(KafkaError(error.code(), f"creating topic {name}: {error.str()}")) from exc
    _wait_for_leaders(admin, created, timeout)
    _warn_on_layout_drift(admin, topics, existing, timeout)
    if created:
        logger.info("created topics: %s", ", ".join(sorted(created)))
    return created


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> None:
    """Creation returns before every partition has a leader; wait, so callers can use the topics at once."""
    deadline = time.monotonic() + timeout
    waiting = set(names)
    while waiting:
        metadata = admin.list_topics(timeout=timeout).topics
        waiting = {
            name for name in waiting
            if name not in metadata or metadata[name].error is not None
            or any(p.leader < 0 for p in metadata[name].partitions.values())
        }
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"topics without a partition leader after {timeout:.0f}s: {sorted(waiting)}")
        if waiting:
            time.sleep(0.1)


def _warn_on_layout_drift(admin: AdminClient, topics: dict[str, TopicConfig], existing: set[str],
                          timeout: float) -> None:
    metadata = admin.list_topics(timeout=timeout).topics
    for name in existing & set(topics):
        have, want = len(metadata[name].partitions), topics[name].partitions
        if have != want:
            logger.warning("topic %s has %d partitions, config asks for %d; kept as it is (partitions can only "
                           "grow: kafka-topics --alter --partitions)", name, have, want)


# (topic, partition) -> (committed offset, end offset)  ->  records between them (``records_lag.py``)
RecordCounter = Callable[[dict[tuple[str, int], tuple[int, int]]], dict[tuple[str, int], Counted]]


@dataclass
class TopicReport:
    name: str
    partitions: int
    end_offsets: list[int]  # high watermark per partition
    groups: dict[str, int] = field(default_factory=dict)  # consumer group -> records it has yet to read here
    exact: dict[str, bool] = field(default_factory=dict)  # consumer group -> its records lag is exact (not capped)

    @property
    def end_offsets_total(self) -> int:
        """The end offsets summed: records, transaction markers and aborted records alike (not a record count)."""
        return sum(self.end_offsets)


def describe_run(admin: AdminClient, consumer: Consumer, readers: OffsetsReaders, topics: list[str],
                 group_prefix: str, count: RecordCounter, timeout: float = 10.0) -> list[TopicReport]:
    """Partitions, end offsets and, for each consumer group whose id starts with ``group_prefix``, its lag in
    records (``count``: from its committed offsets to the end)."""
    metadata = admin.list_topics(timeout=timeout).topics
    reports = []
    for name in topics:
        if name not in metadata:
            continue
        partitions = sorted(metadata[name].partitions)
        ends = [watermarks(consumer, TopicPartition(name, p), timeout)[1] for p in partitions]
        reports.append(TopicReport(name, len(partitions), ends))
    by_name = {r.name: r for r in reports}
    partitions = [TopicPartition(r.name, p) for r in reports for p in range(r.partitions)]
    for group in _groups(admin, group_prefix, timeout):
        spans = {(tp.topic, tp.partition): (tp.offset, by_name[tp.topic].end_offsets[tp.partition])
                 for tp in (readers(group).committed(partitions, timeout=timeout) if partitions else [])
                 if tp.topic in by_name and tp.offset >= 0}
        for (topic, _), counted in count(spans).items():
            report = by_name[topic]
            report.groups[group] = report.groups.get(group, 0) + counted.records
            report.exact[group] = report.exact.get(group, True) and counted.exact
    return reports


def group_lag(admin: AdminClient, consumer: Consumer, reader: Consumer, topic: str, timeout: float = 10.0) -> int:
    """Total lag of ``reader``'s group on ``topic`` (end offset − committed offset, over partitions; uncommitted
    partitions count from their start)."""
    metadata = admin.list_topics(topic=topic, timeout=timeout).topics.get(topic)
    if metadata is None or metadata.error is not None:
        return 0
    committed = _committed(reader, topic, list(metadata.partitions), timeout)
    lag = 0
    for partition in metadata.partitions:
        low, high = watermarks(consumer, TopicPartition(topic, partition), timeout)
        offset = committed.get((topic, partition), -1)
        lag += high - (offset if offset >= 0 else low)
    return lag


def committed_offsets(admin: AdminClient, reader: Consumer, topic: str,
                      timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """Committed next-offsets of ``reader``'s group on ``topic``; partitions without a commit are left out."""
    metadata = admin.list_topics(topic=topic, timeout=timeout).topics.get(topic)
    if metadata is None or metadata.error is not None:
        return {}
    return _committed(reader, topic, list(metadata.partitions), timeout)


def _committed(reader: Consumer, topic: str, partitions: list[int], timeout: float) -> dict[tuple[str, int], int]:
    found = reader.committed([TopicPartition(topic, p) for p in partitions], timeout=timeout)
    return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0}


def watermarks(consumer: Consumer, tp: TopicPartition, timeout: float = 10.0) -> tuple[int, int]:
    """(low, high) offsets of a partition, retrying while leadership settles (new topics, broker restarts).

    A consumer that does not fetch the partition (a probe) keeps the leader it last knew: after that broker dies,
    its queries time out or find the partition unknown ("Local: Unknown partition") for good. So each retry first
    asks the cluster for the topic's metadata again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=max(0.5, min(2.0, deadline - time.monotonic())))
        except KafkaException:
            # NOT_LEADER / LEADER_NOT_AVAILABLE right after creation are not flagged retriable by librdkafka
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            _refresh_metadata(consumer, tp.topic)


def _refresh_metadata(consumer: Consumer, topic: str) -> None:
    try:
        consumer.list_topics(topic, timeout=2.0)
    except KafkaException as exc:  # the next query says what is wrong, or the caller's deadline does
        logger.debug("metadata of %s not refreshed: %s", topic, exc.args[0])


def _groups(admin: AdminClient, prefix: str, timeout: float) -> list[str]:
    listing = admin.list_consumer_groups(request_timeout=timeout).result()
    return sorted(g.group_id for g in listing.valid if g.group_id.startswith(prefix))

