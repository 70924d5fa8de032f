"""What a role did since its last commit, made durable as one: the unit every role loop commits (poll → handle →
commit, :meth:`streamrft.runtime.RoleRuntime.run`; in the spirit of quix-streams' ``Checkpoint``).

A unit holds
- the records the role produced while it handled what it polled (requests, experiences, results, signals,
  metrics, dead letters), produced only when the unit commits;
- the role's state record, when every commit of the role must carry it (the explorer's, which says what the
  committed ``tasks`` offsets leave pending);
- the offsets it consumed: the bound consumer's (the default), or explicit commit points with metadata (a rollout
  worker's ledger), or offsets committed right after the transaction rather than in it (the trainer, whose
  exactly-once position is its own checkpoint file; the committed offsets only tell the explorer its lag);
- actions to run once the commit is durable (a ledger's committed points, counters, log lines, the trainer's
  checkpoint): bookkeeping that must not run ahead of the topics.

A transactional role commits all of that in ONE Kafka transaction (its ``Transactor``: the one abort
policy of ``streamrft.kafka.transaction``: an abortable error runs the same unit again, anything else stops the
role, whose state is in the topics). A role without a transactional id (the monitor) flushes its sinks, then
commits its consumer's offsets: a crash between the two redelivers what the sinks already hold, which they skip.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from streamrft.kafka import RecordProducer, Transactor
from streamrft.kafka.consumer import CommitPoints, Offsets, RecordConsumer
from streamrft.telemetry import MetricsPublisher

logger = logging.getLogger(__name__)

Produce = Callable[[RecordProducer], None]


class UnitOfWork:
    def __init__(self, source: str, producer: RecordProducer, metrics: MetricsPublisher,
                 transactor: Transactor | None, *, state: Callable[[], list[tuple[str, Any]]] | None = None,
                 sinks: tuple[Callable[[], None], ...] = (), consumer: RecordConsumer | None = None):
        """A unit of the role ``source``, written with its ``producer`` (its ``metrics`` too), committed by its
        ``transactor`` (None: a role without transactions). ``state()``: the (topic, record) pairs every commit
        writes (called at commit time, so they say what the unit leaves). ``sinks``: flushed before a
        non-transactional commit. ``consumer``: whose offsets a non-transactional role commits (a transactional
        one commits its transactor's bound consumer's)."""
        self._source = source
        self._producer = producer
        self._metrics = metrics
        self._transactor = transactor
        self._state = state
        self._sinks = sinks
        self._consumer = consumer
        self._reset()

    def _reset(self) -> None:
        self._writes: list[Produce] = []
        self._points: CommitPoints | None = None
        self._offsets_after: tuple[RecordConsumer, Offsets] | None = None
        self._after: list[Callable[[], None]] = []
        self._what: list[str] = []
        self._touched = False

    # -- what the role stages while it handles ---------------------------------------------------------------
    def produce(self, topic: str, record, *, partition: int | None = None) -> None:
        self._writes.append(lambda producer: producer.produce(topic, record, partition=partition))

    def dead_letter(self, letter) -> None:
        self._writes.append(lambda producer: producer.send_dead_letter(letter))

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """The role's metrics for ``step`` on ``metrics``, with the rest of the unit."""
        publisher = self._metrics
        self._writes.append(lambda producer: publisher.publish(step, values))

    def commit_points(self, points: CommitPoints) -> None:
        """Commit these offsets (with their metadata) instead of everything the bound consumer handed out."""
        self._points = points

    def commit_offsets_after(self, consumer: RecordConsumer, offsets: Offsets) -> None:
        """Commit ``offsets`` of ``consumer`` once the unit's transaction is committed, outside it."""
        self._offsets_after = (consumer, offsets)

    def after_commit(self, action: Callable[[], None]) -> None:
        self._after.append(action)

    def describe(self, what: str) -> None:
        """What the unit does, for its log lines and errors ("publishing step 3")."""
        self._what.append(what)

    def discard(self) -> None:
        """Forget what is staged (its commit failed and the role handles that itself)."""
        self._reset()

    def touch(self) -> None:
        """The role's state changed: commit even when nothing else was staged."""
        self._touched = True

    @property
    def due(self) -> bool:
        return bool(self._touched or self._writes or self._points is not None or self._offsets_after is not None
                    or self._after)

    # -- the commit ------------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Make the unit durable as one (see the module docstring); raises when it cannot."""
        if not self.due:
            return
        what = "; ".join(self._what) or f"{self._source}'s work"
        if self._transactor is not None:
            if self._writes or self._touched or self._points is not None or self._state is not None:
                self._transactor.run(self._produce, what, self._points)
        else:
            self._commit_plainly()
        if self._offsets_after is not None:
            consumer, offsets = self._offsets_after
            consumer.commit_offsets(offsets)
        after = self._after
        self._reset()
        for action in after:
            action()

    def _produce(self, producer: RecordProducer) -> None:
        for write in self._writes:
            write(producer)
        for topic, record in self._state() if self._state is not None else ():
            producer.produce(topic, record)

    def _commit_plainly(self) -> None:
        """1. flush the sinks  2. produce and flush  3. commit the consumed offsets."""
        for flush in self._sinks:
            flush()
        if self._writes:
            self._produce(self._producer)
            self._producer.flush()
        if self._consumer is not None:
            self._consumer.commit()
