"""Lag as operators read it: the records a ``read_committed`` reader of the group would still get, not offsets.

A partition's end offset minus a group's committed offset counts offsets, and a transactional producer's every
commit writes a marker that takes an offset and is no record: a partition its group has read to the end shows a lag
of 1 (the marker after the last record), and one written by many small transactions counts nearly twice its
records (aborted records too). Kafka keeps no record count, so the exact figure is read: from the committed offset
to the end, with ``read_committed`` (which skips markers and aborted records, and stops at the last stable offset:
records of a transaction still open are not there yet), counting. Bounded: only partitions whose offset lag is
above 0 are read, at most ``cap`` records each within ``timeout`` seconds; past the cap (or the time), the
offsets not read are added as they are (an upper bound) and the figure says it is not exact.

The explorer paces on offsets (``KafkaClients.lag``): it asks many times a second, needs only an upper bound, and
the trainer commits past the markers it has read."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ..config import KafkaConfig
from .props import consumer_props

RECORDS_CAP = 1000  # records counted per partition, at most
TIMEOUT_S = 5.0
# The counting reader wants ``cap`` records a partition, so it prefetches little: with librdkafka's defaults it
# would queue up to 64 MiB of a group's backlog at every count, memory the process (the monitor, sampling every
# few seconds) does not get back from the allocator and which grew its RSS by about that much over a long run.
PREFETCH = {"queued.max.messages.kbytes": 1024, "max.partition.fetch.bytes": 256 * 1024}

TP = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Counted:
    """Records between a committed offset and the end: ``exact`` False when the cap or the time cut the count
    short (the offsets not read are in ``records`` as they are)."""

    records: int
    exact: bool = True


def count_records(kafka: KafkaConfig, bootstrap: str, spans: dict[TP, tuple[int, int]], cap: int = RECORDS_CAP,
                  timeout: float = TIMEOUT_S) -> dict[TP, Counted]:
    """Per partition, the records a read_committed reader gets from ``start`` up to ``end`` (``spans[tp] =
    (start, end)``, end: the end offset). Partitions with nothing between are 0 without a read."""
    out = {tp: Counted(0) for tp, (start, end) in spans.items() if end <= start}
    todo = {tp: span for tp, span in spans.items() if tp not in out}
    if not todo:
        return out
    props = consumer_props(kafka, bootstrap, f"streamrft-lag-{uuid.uuid4().hex[:8]}") | PREFETCH | {
        "enable.partition.eof": True}
    consumer = Consumer(props)
    counts = dict.fromkeys(todo, 0)
    reached = {tp: start for tp, (start, _) in todo.items()}  # the next offset not yet accounted for
    try:
        consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in todo.items()])
        open_ = set(todo)
        deadline = time.monotonic() + timeout
        while open_ and time.monotonic() < deadline:
            for msg in consumer.consume(500, timeout=0.2):
                tp = (msg.topic(), msg.partition())
                if tp not in open_:
                    continue
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(msg.error())
                    reached[tp] = todo[tp][1]  # the rest up to the end: markers, aborted or open records
                    open_.discard(tp)
                    continue
                if msg.offset() >= todo[tp][1]:
                    reached[tp] = todo[tp][1]
                    open_.discard(tp)
                    continue
                counts[tp] += 1
                reached[tp] = msg.offset() + 1
                if reached[tp] >= todo[tp][1] or counts[tp] >= cap:
                    open_.discard(tp)
            for tp in set(todo) - open_:
                consumer.pause([TopicPartition(*tp)])
    finally:
        consumer.close()
    for tp, (_, end) in todo.items():
        rest = end - reached[tp]
        out[tp] = Counted(counts[tp] + rest, exact=rest == 0)
    return out
