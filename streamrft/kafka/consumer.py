"""Consumer of records: manual commits, read_committed, pause/resume, and a dead-letter route for payloads
that cannot be decoded (the consumer keeps going; the bad record's offset is committed with the rest)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition

from streamrft.schemas import DecodeError, Record
from .dlq import dead_letter
from .producer import RecordProducer
from .serde import Serde

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)
# (topic, partition) -> offset
Offsets = dict[tuple[str, int], int]


@dataclass(slots=True)
class Delivered(Generic[R]):
    """A decoded record and where it came from."""

    record: R
    topic: str
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int
    headers: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


class RecordConsumer(Generic[R]):
    """Reads ``record_type`` records from ``topics``; tracks what it returned so commits cover exactly that."""

    def __init__(self, props: dict, serde: Serde, topics: list[str], record_type: type[R],
                 dlq: RecordProducer | None = None, subscribe: bool = True):
        self.serde = serde
        self.topics = topics
        self.record_type = record_type
        self.group_id = props.get("group.id", "")
        self._dlq = dlq
        self._consumer = Consumer(props)
        # (topic, partition) -> next offset to commit, for everything handed out (decoded or dead-lettered)
        self._pending: dict[tuple[str, int], int] = {}
        self.dead_lettered = 0
        # partitions whose end was reached (needs enable.partition.eof); cleared when a record arrives
        self.at_eof: set[tuple[str, int]] = set()
        if subscribe:
            self._consumer.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                     on_lost=self._on_revoke)

    # -- rebalance ------------------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        logger.info("%s assigned %s", self.group_id, _describe(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        logger.info("%s revoked %s", self.group_id, _describe(partitions))
        for tp in partitions:
            self._pending.pop((tp.topic, tp.partition), None)
            self.at_eof.discard((tp.topic, tp.partition))

    # -- reading --------------------------------------------------------------------------------------------
    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Delivered[R]]:
        """Up to ``max_records`` decoded records; undecodable ones go to ``<topic>.dlq`` with the reason."""
        messages = self._consumer.consume(max_records, timeout)
        out: list[Delivered[R]] = []
        dead = 0
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self.at_eof.add((msg.topic(), msg.partition()))
                self._handle_error(error)
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            self.at_eof.discard((topic, partition))
            try:
                record = self.serde.decode(msg.value(), topic, self.record_type)
            except DecodeError as exc:
                self._dead_letter(msg, exc)
                dead += 1
            else:
                key = msg.key()
                out.append(Delivered(record, topic, partition, offset, key.decode() if key else None,
                                     msg.timestamp()[1], msg.headers() or []))
            self._pending[(topic, partition)] = offset + 1
        if dead and self._dlq is not None:
            # The dead letters must be durable before their source offsets can be committed.
            self._dlq.flush()
        return out

    def _dead_letter(self, msg, exc: DecodeError) -> None:
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        logger.warning("undecodable record at %s key=%r (%s): %s; sent to %s.dlq", where, msg.key(),
                       exc.reason, exc, msg.topic())
        self.dead_lettered += 1
        if self._dlq is None:
            raise RuntimeError(f"undecodable record at {where} and no dead-letter producer configured") from exc
        self._dlq.send_dead_letter(dead_letter(
            topic=msg.topic(), partition=msg.partition(), offset=msg.offset(), key=msg.key(),
            value=msg.value(), error=exc, reason=exc.reason, stage="decode", group=self.group_id,
            original_headers=msg.headers(),
        ))

    def _handle_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if error.fatal():
            raise KafkaException(error)
        logger.warning("consumer %s: %s", self.group_id, error.str())

    # -- committing -----------------------------------------------------------------------------------------
    def pending_offsets(self) -> list[TopicPartition]:
        """Offsets that cover everything ``poll`` returned (for ``commit`` or a transaction)."""
        return [TopicPartition(t, p, o) for (t, p), o in self._pending.items()]

    def commit(self) -> None:
        self.commit_offsets(self._pending)

    def commit_offsets(self, offsets: Offsets) -> None:
        """Commit explicit next-offsets (a caller that holds read records back, e.g. the trainer's buffer,
        commits less than it has read, so the group's lag still counts them)."""
        if offsets:
            self._consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                  asynchronous=False)

    def forget_pending(self) -> None:
        self._pending.clear()

    def rewind_to_committed(self, timeout: float = 10.0) -> None:
        """After an aborted transaction: read again from the last committed offsets of our partitions."""
        assignment = self._consumer.assignment()
        self._pending.clear()
        if not assignment:
            return
        for tp in self._consumer.committed(assignment, timeout=timeout):
            offset = tp.offset if tp.offset != OFFSET_INVALID else OFFSET_BEGINNING
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    def assign(self, offsets: Offsets) -> None:
        """Group-less reading from explicit positions (which also become the pending positions)."""
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in offsets.items()])
        self._pending = dict(offsets)
        self.at_eof.clear()

    def positions(self) -> Offsets:
        """Next offset per partition for everything handed out so far (or as assigned)."""
        return dict(self._pending)

    def fetch_positions(self) -> Offsets:
        """The consumer's own position per assigned partition: unlike :meth:`positions` it moves past
        transaction markers, so it reaches the end offset once a partition is read to its end."""
        out = dict(self._pending)
        for tp in self._consumer.position(self._consumer.assignment()):
            if tp.offset >= 0:
                out[(tp.topic, tp.partition)] = max(tp.offset, out.get((tp.topic, tp.partition), 0))
        return out

    def rewind_to_start(self, timeout: float = 10.0) -> None:
        """Seek every assigned partition to its first offset (a new epoch over the topic); the start becomes
        the pending position, so a commit now records the rewind."""
        for tp in self._consumer.assignment():
            low, _ = self._consumer.get_watermark_offsets(tp, timeout=timeout)
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, low))
            self._pending[(tp.topic, tp.partition)] = low
        self.at_eof.clear()

    def at_end(self) -> bool:
        """True when every assigned partition has reported its end (enable.partition.eof)."""
        assignment = self._consumer.assignment()
        return bool(assignment) and all((tp.topic, tp.partition) in self.at_eof for tp in assignment)

    # -- flow control ---------------------------------------------------------------------------------------
    def pause(self) -> None:
        self._consumer.pause(self._consumer.assignment())

    def resume(self) -> None:
        self._consumer.resume(self._consumer.assignment())

    def assignment(self) -> list[TopicPartition]:
        return self._consumer.assignment()

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self._consumer.seek(TopicPartition(topic, partition, offset))

    @property
    def raw(self) -> Consumer:
        return self._consumer

    def group_metadata(self):
        return self._consumer.consumer_group_metadata()

    def close(self) -> None:
        """Leave the group now, so partitions move to other members without waiting for a session timeout."""
        self._consumer.close()


def _describe(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"
