"""consume -> produce -> commit in one Kafka transaction (``send_offsets_to_transaction``), with ONE abort
policy for every role:

- **any** exception inside a transaction aborts it — a Kafka error, a record that fails to encode, a bug in the
  caller's ``produce`` — so nothing half-done is ever visible to read_committed readers and the producer is
  ready for the next transaction;
- an abortable or retriable Kafka error (``txn_requires_abort``, e.g. the broker restarting) is followed by the
  SAME unit of work again — the same records, the same consumed offsets — under a deadline: the role's
  in-memory state never runs ahead of the topics, and nothing is rewound;
- a librdkafka call that does not return STUCK_GRACE_S after its own timeout (librdkafka #5456 / #5511:
  ``send_offsets_to_transaction`` can block for ever once the group coordinator moved, e.g. across a broker
  restart) is abandoned with its client: the producer is re-created with the same transactional.id, which
  fences the stuck one, and the same unit runs again on it;
- a fatal error that no newer instance caused is also met with a new client and the same unit. That is a
  transaction held up past its transaction.timeout.ms (a broker failover): the coordinator aborts it and bumps the
  producer's epoch, and librdkafka then reports the client fenced (_FENCED) or its abort refused
  (INVALID_TXN_STATE), fatal either way (librdkafka #3297), e.g. a transaction open across its partition leader's
  death. Fencing of a transaction younger than its timeout is a newer instance's. The new client's init_transactions takes the id over with a new epoch, so nothing of the old
  transaction can commit;
- an authorization error (the principal's ACLs do not allow a write, the transactional id or the group) is raised
  at once as ``AuthorizationError``, naming the resource;
- the consumer group no longer knowing this member (its session ended while a coordinator failed over) is raised
  at once as :class:`TransactionFailed`: its partitions may be another member's by now, so the unit's offsets must
  not be committed, and only polling (which the role does, not this loop) lets the consumer rejoin. Retrying it
  here would write one aborted copy of the unit per attempt, each counted as lag by whoever reads the topic;
- anything else is raised after the abort: :class:`FatalTransactionError` when the producer was fenced by a newer
  instance with the same transactional.id (this one must stop), :class:`TransactionFailed` when the deadline
  passed, or the caller's own exception. The role then stops; its state is in the topics, so a restart resumes.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from .consumer import CommitPoints, RecordConsumer
from .producer import RecordProducer
from .retry import retrying

logger = logging.getLogger(__name__)

# Each transaction call gets at most CALL_TIMEOUT_S (and is tried again, within the unit's deadline, when it
# times out); one that has not returned STUCK_GRACE_S after that is taken as stuck. So a client stuck across a
# broker restart (send_offsets_to_transaction once the group coordinator moved) is replaced after ~7 s, not after
# the whole unit's deadline. bench/chaos.py --nodes 3 measures what a rolling restart costs the loop.
CALL_TIMEOUT_S = 5.0
STUCK_GRACE_S = 2.0
MAX_REOPENS = 3  # stuck or failed clients replaced within one unit of work before giving up
# what a newer instance with the same transactional.id does to an older one: the older one must stop, not take the
# id back (that would fence the newer one in turn)
FENCED = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)
# the consumer group has moved on without this member (see the module docstring)
NOT_A_MEMBER = (KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.FENCED_INSTANCE_ID)


class FatalTransactionError(RuntimeError):
    """The producer can no longer be used (fenced, or a fatal broker error); restart the role."""


class TransactionFailed(RuntimeError):
    """A unit of work could not be committed before the deadline; nothing of it is visible."""


class MembershipLost(TransactionFailed):
    """The unit's offsets belong to a consumer group that no longer has this member (it missed its session or
    max.poll.interval.ms, e.g. through a coordinator's failover): nothing of the unit is visible, and its
    partitions may be another member's now. A role that holds nothing but what it read since its last commit
    rejoins the group (:meth:`RecordConsumer.rejoin`) and reads again from the committed offsets (every role's
    ``rejoin``, :mod:`streamrft.runtime.role_runtime`)."""


class ProducerStuck(RuntimeError):
    """A librdkafka call blocked past its timeout (see the module docstring)."""


class Transactor:
    """Runs units of work, each in one transaction together with the consumer's pending offsets."""

    def __init__(self, producer: RecordProducer, consumer: RecordConsumer | None = None, timeout: float = 60.0):
        if not producer.transactional:
            raise ValueError("Transactor needs a producer created with a transactional.id")
        self.producer = producer
        self.consumer = consumer
        self.timeout = timeout
        self.committed = 0
        self.aborted = 0
        self.replaced = 0  # clients replaced (stuck, or failed for good without a newer instance)
        self._began = time.monotonic()  # when the current (or last) transaction began
        producer.init_transactions(timeout)

    def run(self, produce: Callable[[RecordProducer], None], what: str = "a unit of work",
            offsets: CommitPoints | None = None) -> None:
        """1. begin  2. produce  3. add the consumed offsets  4. commit — retried whole on abortable errors
        until ``timeout``; raises when the unit cannot be committed (see the module docstring). ``offsets``: commit
        these (with their metadata) instead of everything the consumer handed out."""
        deadline = time.monotonic() + self.timeout
        attempt = reopened = 0
        while True:
            attempt += 1
            try:
                self._attempt(produce, offsets)
                break
            except ProducerStuck as exc:
                if reopened >= MAX_REOPENS:
                    raise TransactionFailed(f"could not commit {what}: {exc}, {reopened} time(s)") from exc
                reopened += 1
                logger.error("%s while committing %s; replacing the producer (same transactional.id, which fences "
                             "the stuck one) and trying the same unit again", exc, what)
                self._reopen()
                deadline = time.monotonic() + self.timeout
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                self._abort(f"{what}: {error.str()}")
                refused = self.producer.refusal(error, self.consumer.group_id if self.consumer is not None else "")
                if refused is not None:  # an ACL does not appear by trying again
                    raise refused from exc
                if error.fatal():
                    cause = self._not_a_newer_instance(error)
                    if cause is None or reopened >= MAX_REOPENS:
                        raise FatalTransactionError(
                            f"fatal transaction error while committing {what} ({error.name()}): {error.str()}; "
                            "another instance with the same transactional.id may have taken over; restart this "
                            "role") from exc
                    reopened += 1
                    logger.error("fatal transaction error while committing %s (%s: %s); %s: replacing the producer "
                                 "(same transactional.id) and trying the same unit again", what, error.name(),
                                 error.str(), cause)
                    self._reopen()
                    deadline = time.monotonic() + self.timeout
                    continue
                if error.code() in NOT_A_MEMBER:
                    raise MembershipLost(
                        f"could not commit {what}: the consumer group no longer has this member "
                        f"({error.name()}: {error.str()}); its partitions may be another member's now, and their "
                        "work is redone by whoever reads them (the role joins the group again by itself and goes on "
                        "from what it committed)") from exc
                if not (error.txn_requires_abort() or error.retriable()):
                    raise TransactionFailed(f"could not commit {what}: {error.str()}") from exc
                if time.monotonic() >= deadline:
                    raise TransactionFailed(f"could not commit {what} in {self.timeout:.0f}s ({attempt} attempts; "
                                            f"last: {error.str()}); is the broker up?") from exc
                logger.warning("transaction for %s aborted (%s); trying the same unit again (%d)", what,
                               error.str(), attempt)
                time.sleep(min(0.2 * attempt, 2.0))
            except BaseException as exc:
                self._abort(f"{what}: {type(exc).__name__}: {exc}")
                raise
        if self.consumer is not None:
            self.consumer.forget_pending()
        self.committed += 1

    def _not_a_newer_instance(self, error: KafkaError) -> str | None:
        """Why a fatal error was not caused by a newer instance with this transactional.id, or None when it may
        have been (see the module docstring)."""
        if error.code() not in FENCED:
            return "no fencing"
        open_s = time.monotonic() - self._began
        if open_s >= self.producer.transaction_timeout_s:
            return (f"the transaction was open {open_s:.0f} s, past its transaction.timeout.ms: the coordinator "
                    "aborted it and fenced this client itself")
        return None

    def _attempt(self, produce: Callable[[RecordProducer], None], points: CommitPoints | None) -> None:
        raw = self.producer.raw
        self.producer.topics_written.clear()
        raw.begin_transaction()
        self._began = time.monotonic()  # not if begin failed: the failure belongs to the transaction before
        produce(self.producer)
        if points is not None:
            offsets = [TopicPartition(t, p, o, metadata=m) for (t, p), (o, m) in points.items()]
        else:
            offsets = self.consumer.pending_offsets() if self.consumer is not None else []
        if offsets:
            metadata = self.consumer.group_metadata()
            self._retrying("send_offsets_to_transaction",
                           lambda t: raw.send_offsets_to_transaction(offsets, metadata, t))
        self._retrying("commit_transaction", lambda t: raw.commit_transaction(t))
        self.producer.raise_delivery_errors()

    def _retrying(self, what: str, call: Callable[[float], None]) -> None:
        # an error that requires an abort is never retried in place: the whole unit is (see run)
        retrying(what, lambda t: _bounded(what, call, min(t, CALL_TIMEOUT_S)), self.timeout,
                 retry_when=lambda e: e.retriable() and not e.txn_requires_abort())

    def _abort(self, why: str) -> None:
        """Abort the open transaction, if any (best effort: a fatal producer cannot abort)."""
        self.aborted += 1
        logger.warning("transaction aborted: %s", why)
        try:
            self._retrying("abort_transaction", lambda t: self.producer.raw.abort_transaction(t))
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() != KafkaError._STATE and not error.fatal():
                logger.warning("abort_transaction: %s", error.str())
        except ProducerStuck as exc:  # a new client fences the stuck one; the broker aborts its transaction
            logger.error("%s; replacing the producer", exc)
            self._reopen()
        self.producer.discard_delivery_errors()  # the aborted records are discarded anyway

    def _reopen(self) -> None:
        self.replaced += 1
        self.producer.reopen()
        self.producer.init_transactions(self.timeout)


def _bounded(what: str, call: Callable[[float], None], timeout: float) -> None:
    """``call(timeout)`` on a helper thread (librdkafka releases the GIL while it blocks); raises ProducerStuck
    when it has not returned STUCK_GRACE_S after ``timeout``, else whatever it raised."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call(timeout)
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread below
            outcome.append(exc)

    thread = threading.Thread(target=target, name=f"txn-{what}", daemon=True)
    thread.start()
    thread.join(timeout + STUCK_GRACE_S)
    if not outcome:
        raise ProducerStuck(f"{what} has not returned {timeout + STUCK_GRACE_S:.0f}s after a {timeout:.0f}s timeout")
    if outcome[0] is not None:
        raise outcome[0]
