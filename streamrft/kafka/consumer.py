"""Consumer of records: manual commits, read_committed, pause/resume, and the edge where every record is
checked once.

A record is handed to the role only when its key is UTF-8 (or absent), its value is no larger than the run
allows, it decodes as the expected record type and it passes that type's check (``check``, see
``streamrft.validation``). Anything else goes to ``<topic>.dlq`` with the reason, stage and source coordinates
— once per consumer group (:class:`DeadLetterLedger`), however often the record is read again — and its offset
moves on with the rest: nothing a producer writes can stop a role. What the principal may not read (its ACLs) is
raised as an AuthorizationError naming the topic or group."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Callable, Generic, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from streamrft.schemas import DecodeError, InvalidRecordError, Record
from .authorization import Refusal, is_refusal
from .dlq import DeadLetterLedger, dead_letter
from .producer import RecordProducer
from .serde import Serde
from .unanswered import unanswered

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)
# (topic, partition) -> offset
Offsets = dict[tuple[str, int], int]
# (topic, partition) -> (next offset, metadata): a commit that also says which later offsets are done
CommitPoints = dict[tuple[str, int], tuple[int, str]]
# raises InvalidRecordError when a decoded record breaks its type's invariants
Check = Callable[[R], None]
# one check for every topic read, or topic -> its own (one reader of topics whose writers promise different things)
Checks = Check | Mapping[str, Check]


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
                 dlq: RecordProducer | None = None, subscribe: bool = True, *, check: Checks | None = None,
                 ledger: DeadLetterLedger | None = None, max_record_bytes: int | None = None,
                 on_dead_letter: Callable[[str, str], None] | None = None, refuse: Refusal | None = None):
        """``dlq`` None: bad records are skipped and logged but not dead-lettered (another reader of the same
        records owns their dead letters, e.g. the explorer for ``sync``)."""
        self.serde = serde
        self.topics = topics
        self.record_type = record_type
        self.group_id = props.get("group.id", "")
        self._dlq = dlq
        self._checks: Mapping[str, Check] = (check if isinstance(check, Mapping) else
                                             {topic: check for topic in topics} if check is not None else {})
        self._ledger = ledger if ledger is not None else DeadLetterLedger(self.group_id)
        self._max_record_bytes = max_record_bytes
        self._on_dead_letter = on_dead_letter
        self._refuse = refuse
        self._consumer = Consumer(props)
        # (topic, partition) -> next offset to commit, for everything handed out (decoded or dead-lettered)
        self._pending: dict[tuple[str, int], int] = {}
        self.dead_lettered = 0  # sent to the DLQ by this consumer
        self.rejected = 0  # bad records skipped, whether sent now, already sent before, or owned by another reader
        # partitions whose end was reached (needs enable.partition.eof); cleared when a record arrives
        self.at_eof: set[tuple[str, int]] = set()
        self.assigned: set[tuple[str, int]] = set()  # this member's partitions, as of the last rebalance
        # partitions taken away since the last take_revoked(): their position restarts from the committed offset
        # when they come back, so whatever was read from them and not committed is read again
        self._revoked: set[tuple[str, int]] = set()
        self.paused = False  # see pause(): also applied to partitions assigned while paused
        self.focus: str | None = None  # see read_only(): the one topic fetched from, of several
        self.subscribed = subscribe
        if subscribe:
            self._subscribe()

    def _subscribe(self) -> None:
        self._consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_revoke)

    # -- rebalance ------------------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        logger.info("%s assigned %s", self.group_id, _describe(partitions))
        self.assigned.update((tp.topic, tp.partition) for tp in partitions)
        # librdkafka keeps a partition's pause flag across rebalances: a partition paused under an earlier
        # assignment would come back paused for good. Each partition gets the consumer's current state.
        consumer.assign(partitions)
        stopped = [tp for tp in partitions if self._stopped(tp.topic)]
        consumer.pause(stopped)
        consumer.resume([tp for tp in partitions if not self._stopped(tp.topic)])

    def _stopped(self, topic: str) -> bool:
        return self.paused or (self.focus is not None and topic != self.focus)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        logger.info("%s revoked %s", self.group_id, _describe(partitions))
        for tp in partitions:
            self.assigned.discard((tp.topic, tp.partition))
            self._revoked.add((tp.topic, tp.partition))
            self._pending.pop((tp.topic, tp.partition), None)
            self.at_eof.discard((tp.topic, tp.partition))

    # -- reading --------------------------------------------------------------------------------------------
    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Delivered[R]]:
        """Up to ``max_records`` checked records; bad ones go to ``<topic>.dlq`` (see the module docstring)."""
        messages = self._consumer.consume(max_records, timeout)
        out: list[Delivered[R]] = []
        sent = False
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self.at_eof.add((msg.topic(), msg.partition()))
                self._handle_error(error, msg.topic())
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            self.at_eof.discard((topic, partition))
            try:
                out.append(self._read(msg))
            except InvalidRecordError as exc:
                sent |= self._reject(msg, exc, "validate")
            except DecodeError as exc:
                sent |= self._reject(msg, exc, "decode")
            self._pending[(topic, partition)] = offset + 1
        if sent:
            # The dead letters must be durable before their source offsets can be committed.
            self._dlq.flush()
        return out

    def _read(self, msg) -> Delivered[R]:
        """Key, size, framing and schema, then the record type's own invariants; raises DecodeError."""
        raw_key, value = msg.key(), msg.value()
        try:
            key = raw_key.decode() if raw_key is not None else None
        except UnicodeDecodeError as exc:
            raise DecodeError(f"record key is not UTF-8 ({exc.reason} at byte {exc.start}); keys are strings "
                              "(task_id, request_id, group_id, ...)") from None
        if self._max_record_bytes is not None and value is not None and len(value) > self._max_record_bytes:
            raise InvalidRecordError("oversized", f"record of {len(value):,} bytes; this run reads at most "
                                     f"{self._max_record_bytes:,} on {msg.topic()}")
        record = self.serde.decode(value, msg.topic(), self.record_type)
        check = self._checks.get(msg.topic())
        if check is not None:
            check(record)
        return Delivered(record, msg.topic(), msg.partition(), msg.offset(), key, msg.timestamp()[1],
                         msg.headers() or [])

    def _reject(self, msg, exc: DecodeError, stage: str) -> bool:
        """Dead-letter a bad record unless this group already did; True when a letter was sent now."""
        where = (msg.topic(), msg.partition(), msg.offset())
        self.rejected += 1
        if where in self._ledger:
            logger.info("bad record at %s[%d]@%d was dead-lettered before (%s); skipped", *where, exc.reason)
            return False
        logger.warning("bad record at %s[%d]@%d key=%r (%s at %s): %s; %s", *where, msg.key(), exc.reason, stage,
                       exc, f"sent to {msg.topic()}.dlq" if self._dlq is not None else "skipped")
        if self._dlq is None:
            return False
        self._dlq.send_dead_letter(dead_letter(
            topic=msg.topic(), partition=msg.partition(), offset=msg.offset(), key=msg.key(),
            value=msg.value(), error=exc, reason=exc.reason, stage=stage, group=self.group_id,
            original_headers=msg.headers(),
        ))
        self._ledger.add(where)
        self.dead_lettered += 1
        if self._on_dead_letter is not None:
            self._on_dead_letter(msg.topic(), exc.reason)
        return True

    def _handle_error(self, error: KafkaError, topic: str | None = None) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if self._refuse is not None and is_refusal(error):  # an ACL does not appear by polling again
            if error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
                if not self.subscribed:  # librdkafka looks the coordinator up anyway; a reader by assign()
                    logger.debug("consumer %s: %s (not needed: no group membership)", self.group_id, error.str())
                    return  # never joins or commits, so it needs no ACL on its group
                raise self._refuse(error, "read", self.group_id)
            raise self._refuse(error, "read", topic or " or ".join(self.topics))
        if error.fatal():
            raise KafkaException(error)
        logger.warning("consumer %s: %s", self.group_id, error.str())

    # -- committing -----------------------------------------------------------------------------------------
    def pending_offsets(self) -> list[TopicPartition]:
        """Offsets that cover everything ``poll`` returned (for ``commit`` or a transaction)."""
        return [TopicPartition(t, p, o) for (t, p), o in self._pending.items()]

    def commit(self) -> None:
        self.commit_offsets(self._pending)

    def commit_offsets(self, offsets: Offsets, metadata: dict[tuple[str, int], str] | None = None) -> None:
        """Commit explicit next-offsets (a caller that holds read records back, e.g. the trainer's buffer,
        commits less than it has read, so the group's lag still counts them), each with its ``metadata``
        string, if given (what :meth:`committed` reads back)."""
        if offsets:
            marks = metadata or {}
            self._consumer.commit(offsets=[TopicPartition(t, p, o, metadata=marks.get((t, p), ""))
                                           for (t, p), o in offsets.items()], asynchronous=False)

    def committed(self, partitions: list[tuple[str, int]], timeout: float = 10.0) -> CommitPoints:
        """The group's committed offset and metadata of each partition (offset -1 when none is committed). A
        group coordinator that is moving (a broker failing over: NOT_COORDINATOR and the like) is asked again
        until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self._consumer.committed([TopicPartition(t, p) for t, p in partitions],
                                                 timeout=max(1.0, deadline - time.monotonic()))
                break
            except KafkaException as exc:
                if time.monotonic() >= deadline or not unanswered(exc):
                    raise
                logger.warning("consumer %s: committed offsets not read yet (%s); asking again", self.group_id,
                               exc.args[0].str())
                time.sleep(0.5)
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else -1, tp.metadata or "") for tp in found}

    def rejoin(self) -> None:
        """Join the group anew after it let this member go (a commit answered UNKNOWN_MEMBER_ID or
        ILLEGAL_GENERATION): every partition counts as revoked now (:meth:`take_revoked`), and whatever the group
        gives this member next is read from its committed offset, not from where this member had read to."""
        for partition in self.assigned:
            self._revoked.add(partition)
        self.assigned.clear()
        self._pending.clear()
        self.at_eof.clear()
        self._consumer.unsubscribe()
        self._subscribe()

    def take_revoked(self) -> set[tuple[str, int]]:
        """Partitions revoked since the last call (see ``_revoked``)."""
        revoked, self._revoked = self._revoked, set()
        return revoked

    def forget_pending(self) -> None:
        self._pending.clear()

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

    def rewind_to_start(self, timeout: float = 10.0, topic: str | None = None) -> None:
        """Seek every assigned partition (of ``topic``, when given) to its first offset (a new epoch over the
        topic); the start becomes the pending position, so a commit now records the rewind."""
        for tp in self._consumer.assignment():
            if topic is not None and tp.topic != topic:
                continue
            low, _ = self._consumer.get_watermark_offsets(tp, timeout=timeout)
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, low))
            self._pending[(tp.topic, tp.partition)] = low
            self.at_eof.discard((tp.topic, tp.partition))

    def at_end(self, topic: str | None = None) -> bool:
        """True when every assigned partition (of ``topic``, when given) has reported its end
        (enable.partition.eof)."""
        assignment = [tp for tp in self._consumer.assignment() if topic is None or tp.topic == topic]
        return bool(assignment) and all((tp.topic, tp.partition) in self.at_eof for tp in assignment)

    # -- flow control ---------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop fetching from every assigned partition, and from those assigned later, until :meth:`resume`."""
        self.paused = True
        self._consumer.pause(self._consumer.assignment())

    def resume(self) -> None:
        self.paused = False
        self._consumer.resume([tp for tp in self._consumer.assignment() if not self._stopped(tp.topic)])

    def read_only(self, topic: str | None) -> None:
        """Of the topics subscribed, fetch only from ``topic`` from now on (None: from all of them again): one
        consumer keeps one position per topic, each advanced when its reader wants more (several tasksets, each
        its own topic, committed in one transaction)."""
        if topic == self.focus:
            return
        self.focus = topic
        assignment = self._consumer.assignment()
        self._consumer.pause([tp for tp in assignment if self._stopped(tp.topic)])
        self._consumer.resume([tp for tp in assignment if not self._stopped(tp.topic)])

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
