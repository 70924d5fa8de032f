"""Read-only views of a cluster for people (``streamrft ui``): topics with their partitions, watermarks and
replicas, consumer groups with their lag per partition (in records, ``records_lag.py``), and the last records of a
topic. Nothing here writes,
commits or joins a group.

Committed offsets come from an offsets reader (a consumer with the group's id that never joins it), as
everywhere in the client layer: see kafka/admin.py for why not the admin API's group-offset request."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from ..config import KafkaConfig
from .admin import OffsetsReaders, RecordCounter, watermarks
from .props import consumer_props
from .reader import RawRecord, records_to_eof


@dataclass(frozen=True, slots=True)
class PartitionState:
    partition: int
    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    start: int  # first offset still in the log
    end: int  # next offset to be written (high watermark)

    @property
    def records(self) -> int:
        """Offsets in the log; transaction markers and compacted-away records count too (Kafka keeps no count)."""
        return self.end - self.start

    @property
    def under_replicated(self) -> bool:
        return len(self.isr) < len(self.replicas)


@dataclass(frozen=True, slots=True)
class TopicState:
    name: str
    partitions: tuple[PartitionState, ...]

    @property
    def records(self) -> int:
        return sum(p.records for p in self.partitions)

    @property
    def replication_factor(self) -> int:
        return max((len(p.replicas) for p in self.partitions), default=0)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int
    end: int
    records: int  # what a read_committed reader of the group has yet to get here (records_lag.py)
    exact: bool = True  # False: the count was capped, the offsets past the cap counted as they are

    @property
    def lag(self) -> int:
        """The group's lag here in records: transaction markers take offsets and are none."""
        return self.records

    @property
    def offsets(self) -> int:
        """End offset minus committed offset: records, transaction markers and aborted records alike."""
        return max(self.end - self.committed, 0)


@dataclass(frozen=True, slots=True)
class GroupState:
    group: str
    state: str  # STABLE, EMPTY, PREPARING_REBALANCE ... as the coordinator lists it
    partitions: tuple[PartitionLag, ...]  # those the group has committed offsets on

    def lag_by_topic(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.partitions:
            out[p.topic] = out.get(p.topic, 0) + p.lag
        return out


def topic_names(admin: AdminClient, prefix: str, timeout: float = 10.0) -> list[str]:
    """The topics whose name starts with ``prefix``, sorted; Kafka's internal ones are left out."""
    return sorted(name for name in admin.list_topics(timeout=timeout).topics
                  if name.startswith(prefix) and not name.startswith("__"))


def describe_topics(admin: AdminClient, probe: Consumer, names: list[str], timeout: float = 10.0,
                    ) -> list[TopicState]:
    """Partitions of each topic in ``names`` that exists: leader, replicas, in-sync replicas and watermarks."""
    metadata = admin.list_topics(timeout=timeout).topics
    out = []
    for name in names:
        topic = metadata.get(name)
        if topic is None or topic.error is not None:
            continue
        partitions = []
        for pid in sorted(topic.partitions):
            p = topic.partitions[pid]
            start, end = watermarks(probe, TopicPartition(name, pid), timeout)
            partitions.append(PartitionState(pid, p.leader, tuple(p.replicas), tuple(p.isrs), start, end))
        out.append(TopicState(name, tuple(partitions)))
    return out


def describe_groups(admin: AdminClient, readers: OffsetsReaders, topics: list[TopicState], prefix: str,
                    count: RecordCounter, timeout: float = 10.0) -> list[GroupState]:
    """Each consumer group whose id starts with ``prefix``: its state and, on every partition of ``topics`` it
    has committed, the committed offset against the end and the records between (``count``)."""
    ends = {(t.name, p.partition): p.end for t in topics for p in t.partitions}
    wanted = [TopicPartition(topic, partition) for topic, partition in ends]
    listing = admin.list_consumer_groups(request_timeout=timeout).result()
    out = []
    for group in sorted(listing.valid, key=lambda g: g.group_id):
        if not group.group_id.startswith(prefix):
            continue
        found = readers(group.group_id).committed(wanted, timeout=timeout) if wanted else []
        spans = {(tp.topic, tp.partition): (tp.offset, ends[(tp.topic, tp.partition)]) for tp in found
                 if tp.offset >= 0}
        counted = count(spans)
        lags = tuple(PartitionLag(t, p, committed, end, counted[(t, p)].records, counted[(t, p)].exact)
                     for (t, p), (committed, end) in spans.items())
        state = group.state.name if group.state is not None else "UNKNOWN"
        out.append(GroupState(group.group_id, state, lags))
    return out


def read_last(kafka: KafkaConfig, bootstrap: str, topic: str, per_partition: int,
              keep: Callable[[RawRecord], bool] = lambda raw: True, timeout: float = 20.0) -> list[RawRecord]:
    """The last ``per_partition`` committed offsets of every partition of ``topic`` that ``keep`` accepts,
    oldest first (by timestamp). Reads exactly to the end offsets (partition EOF), so it returns at once on an
    idle topic; a topic that does not exist reads as empty."""
    props = consumer_props(kafka, bootstrap, f"streamrft-inspect-{uuid.uuid4().hex[:8]}") | {
        "enable.partition.eof": True}
    consumer = Consumer(props)
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return []
        assignment, open_partitions = [], set()
        for pid in metadata.partitions:
            start, end = watermarks(consumer, TopicPartition(topic, pid), timeout)
            if end > start:
                assignment.append(TopicPartition(topic, pid, max(start, end - per_partition)))
                open_partitions.add(pid)
        consumer.assign(assignment)
        records = [raw for raw in records_to_eof(consumer, open_partitions, time.monotonic() + timeout) if keep(raw)]
        return sorted(records, key=lambda r: (r.timestamp_ms, r.partition, r.offset))
    finally:
        consumer.close()
