"""Group-less reading of whole topics (tail, tests, reports): assign every partition, read from the beginning
or the end, stop when idle or after ``limit`` records. Commits nothing."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from ..config import KafkaConfig
from .props import consumer_props
from .retry import retrying


@dataclass(frozen=True, slots=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp_ms: int

    @classmethod
    def of(cls, msg) -> "RawRecord":
        """What a consumed message holds."""
        return cls(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), msg.headers() or [],
                   msg.timestamp()[1])


def records_to_eof(consumer: Consumer, open_partitions: set[int], deadline: float) -> Iterator[RawRecord]:
    """The records of an assigned consumer with ``enable.partition.eof`` until each partition of
    ``open_partitions`` reaches its end (it is then removed from the set) or ``deadline`` (monotonic) passes:
    what is left in ``open_partitions`` says whether every end was reached."""
    while open_partitions and time.monotonic() <= deadline:
        msg = consumer.poll(0.2)
        if msg is None:
            continue
        if msg.error() is not None:
            if msg.error().code() == KafkaError._PARTITION_EOF:
                open_partitions.discard(msg.partition())
                continue
            raise KafkaException(msg.error())
        yield RawRecord.of(msg)


def read_topic(kafka: KafkaConfig, bootstrap: str, topic: str, *, from_beginning: bool = True,
               idle_timeout: float | None = 3.0, limit: int | None = None, read_committed: bool = True,
               ) -> Iterator[RawRecord]:
    """Yield records of every partition of ``topic``. With ``from_beginning`` and an ``idle_timeout`` it ends
    once it has reached the end offsets seen at start and nothing new came for ``idle_timeout`` seconds;
    ``idle_timeout=None`` follows the topic until the caller stops iterating."""
    props = consumer_props(kafka, bootstrap, f"streamrft-reader-{uuid.uuid4().hex[:8]}",
                           read_committed=read_committed)
    consumer = Consumer(props)
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if metadata is None or metadata.error is not None:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"topic {topic} does not exist"))
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        consumer.assign([TopicPartition(topic, p, start) for p in metadata.partitions])
        count = 0
        last = time.monotonic()
        while limit is None or count < limit:
            msg = consumer.poll(0.2)
            if msg is None:
                if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                    return
                continue
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(msg.error())
            last = time.monotonic()
            count += 1
            yield RawRecord.of(msg)
    finally:
        consumer.close()


def read_to_end(kafka: KafkaConfig, bootstrap: str, topic: str, timeout: float = 30.0) -> list[RawRecord]:
    """Every committed record of ``topic`` up to the end offsets at call time (exactly to the end: partition
    EOF events, not an idle timeout). The end of a partition is its last stable offset (read_committed): a
    record written after an open transaction began is not read until that transaction ends. A topic that does
    not exist reads as empty."""
    props = consumer_props(kafka, bootstrap, f"streamrft-reader-{uuid.uuid4().hex[:8]}") | {
        "enable.partition.eof": True}
    consumer = Consumer(props)
    try:
        partitions: list[TopicPartition] = []
        open_partitions: set[int] = set()

        def find_ends(remaining: float) -> None:
            partitions.clear()
            open_partitions.clear()
            metadata = consumer.list_topics(topic, timeout=min(remaining, 10)).topics.get(topic)
            if metadata is None or metadata.error is not None:
                return
            partitions.extend(TopicPartition(topic, p, OFFSET_BEGINNING) for p in metadata.partitions)
            open_partitions.update(tp.partition for tp in partitions
                                   if consumer.get_watermark_offsets(tp, timeout=10)[1] > 0)

        # a role that starts while the broker restarts waits for it, up to ``timeout``; so does one that reads a
        # topic created a moment ago, whose partitions have no leader yet
        retrying(f"finding the end of {topic}", find_ends, timeout, pause=1.0, retry_when=lambda e: e.retriable()
                 or e.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
                                 KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                                 KafkaError.UNKNOWN_TOPIC_OR_PART))
        if not partitions:
            return []
        consumer.assign([tp for tp in partitions if tp.partition in open_partitions])
        records = list(records_to_eof(consumer, open_partitions, time.monotonic() + timeout))
        if open_partitions:
            raise TimeoutError(f"could not read {topic} to its end in {timeout:.0f}s; is the broker up?")
        return records
    finally:
        consumer.close()
