"""Serve mode's feedback, from the call to the commit (``role.py`` says what exactly once and the groups mean): the
desk answers ``POST /feedback``, from a receipt or by turning a pending completion into an experience that it hands
to the writer; the writer, a role loop of its own, commits every feedback waiting in one transaction."""
from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from streamrft.config import RunConfig
from streamrft.config.roles import ServeConfig
from streamrft.engines.workflows.base import WorkflowSample
from streamrft.kafka.transaction import FatalTransactionError
from streamrft.lifecycle import StopSignal
from streamrft.metric_catalog import prometheus_metric
from streamrft.runtime import UnitOfWork
from streamrft.schemas import Experience, FeedbackReceipt, RolloutKind

from .feedback import Conversations, FeedbackError, Grouping, Pending, PendingExperiences, Receipts

logger = logging.getLogger(__name__)

RECEIPT_POLL_S = 0.05


@dataclass
class Answer:
    """What ``/feedback`` answers: the HTTP status and its body."""

    status: int
    body: dict


def receipt_body(receipt: FeedbackReceipt) -> dict:
    return {"eid": receipt.eid, "group_id": receipt.group_id, "group_size": receipt.group_size,
            "run_index": receipt.run_index, "model_version": receipt.model_version}


class _StillWriting(FeedbackError):
    """A feedback whose transaction has not ended by ``serve.feedback_timeout_s``: it stays with the writer (a
    call sent again meanwhile waits for its outcome)."""


@dataclass(eq=False)
class _Write:
    """Feedback waiting for the writer's next transaction. ``undo`` gives its responses back when it fails;
    ``release`` lets a second call for the same choice (waiting meanwhile) answer."""

    experiences: list[Experience]
    receipts: list[FeedbackReceipt]
    undo: Callable[[], None]
    release: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        if error is not None:
            self.undo()
        self.release()
        self.done.set()


class FeedbackDesk:
    """What ``POST /feedback`` answers, and the feedback waiting for the writer. Thread-safe: HTTP calls come
    from many threads, the writer takes from its own."""

    def __init__(self, settings: ServeConfig, server_id: str, pending: PendingExperiences, receipts: Receipts,
                 stop: StopSignal, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.server_id = server_id
        self.stop = stop
        self.pending = pending
        self.receipts = receipts
        self.grouping = Grouping(settings.grouping, settings.group_size, server_id)
        self.conversations = Conversations(settings.pending_ttl_s)
        self.c_feedback = prometheus_metric("streamrft_serve_feedback", registry)
        self._writes: deque[_Write] = deque()
        self._writes_ready = threading.Condition()
        self._in_flight: dict[tuple[str, int], threading.Event] = {}  # feedback being written, by choice
        self._in_flight_lock = threading.Lock()

    def feedback(self, response_id: str, choice: int, reward: float, *, group_id: str | None = None,
                 group_size: int | None = None, end_conversation: bool = False) -> Answer:
        """What ``POST /feedback`` answers (the module docstring); raises FeedbackError for a refusal."""
        if not math.isfinite(reward):  # the HTTP body is checked already; this guards every other caller
            self._refused()
            raise FeedbackError(400, f"reward: {reward} is not a finite number")
        conversational = self.settings.grouping == "conversation"
        if end_conversation and not conversational:
            self._refused()
            raise FeedbackError(400, "end_conversation needs serve.grouping: conversation (this server groups by "
                                     f"{self.settings.grouping})")
        answered = self._answer_from_receipt(response_id, choice, reward)
        if answered is not None:
            return answered
        key, mine = (response_id, choice), threading.Event()
        with self._in_flight_lock:
            busy = self._in_flight.setdefault(key, mine)
        if busy is not mine:  # the same feedback, being written now: its outcome is this one's
            busy.wait(self.settings.feedback_timeout_s)
            answered = self._answer_from_receipt(response_id, choice, reward)
            if answered is not None:
                return answered
            raise FeedbackError(503, f"the feedback on {response_id} choice {choice} sent before this one is not "
                                     "written (yet); send it again")
        release = lambda: self._release(key, mine)  # noqa: E731
        try:
            return self._feedback(response_id, choice, reward, group_id, group_size, end_conversation, release)
        except _StillWriting:
            raise  # the writer holds it: the choice is released when its transaction ends, either way
        except BaseException:
            release()
            raise

    def _release(self, key: tuple[str, int], event: threading.Event) -> None:
        """The feedback on ``key`` that ``event`` stands for is written or given back: a call waiting for it may
        answer, and a new one may start (released twice, the second time is a no-op)."""
        with self._in_flight_lock:
            if self._in_flight.get(key) is event:
                del self._in_flight[key]
        event.set()

    def _answer_from_receipt(self, response_id: str, choice: int, reward: float) -> Answer | None:
        receipt = self.receipts.get(response_id, choice)
        if receipt is None:
            return None
        if receipt.reward != reward:
            self._refused()
            raise FeedbackError(409, f"response {response_id} choice {choice} has had its feedback already "
                                     f"(reward {receipt.reward}, this one {reward})")
        self.c_feedback.labels("replayed").inc()
        return Answer(200, receipt_body(receipt))

    def _feedback(self, response_id: str, choice: int, reward: float, group_id: str | None,
                  group_size: int | None, end_conversation: bool, release: Callable[[], None]) -> Answer:
        try:
            pending = self.pending.take(response_id, choice)
        except FeedbackError:
            self._refused()
            raise
        if self.settings.grouping == "conversation":
            return self._converse(pending, reward, end_conversation, release)
        try:
            group, size, index = self.grouping.assign(pending, group_id, group_size)
        except FeedbackError:
            self.pending.give_back(pending)
            self._refused()
            raise
        experience, receipt = self._experience(pending, reward, group, size, index)
        self._write(_Write([experience], [receipt], undo=lambda: self.pending.give_back(pending), release=release),
                    f"the feedback on {response_id}")
        return Answer(200, receipt_body(receipt))

    def _converse(self, pending: Pending, reward: float, end: bool, release: Callable[[], None]) -> Answer:
        if not pending.conversation:
            self.pending.give_back(pending)
            self._refused()
            raise FeedbackError(400, "serve.grouping is conversation: the request must name its conversation "
                                     "(conversation_id in the request body)")
        held = self.conversations.add(pending, reward)
        self.c_feedback.labels("held").inc()
        if not end:
            release()
            return Answer(202, {"written": [], "group_size": 0, "held": held})
        responses = self.conversations.end(pending.conversation)
        group = f"{self.server_id}-{pending.conversation}"
        written = [self._experience(p, r, group, len(responses), i) for i, (p, r) in enumerate(responses)]

        def undo() -> None:  # the conversation stays open and this feedback may be sent again
            self.conversations.give_back(pending.conversation, responses[:-1])
            self.pending.give_back(pending)

        self._write(_Write([e for e, _ in written], [r for _, r in written], undo=undo, release=release),
                    f"conversation {pending.conversation}")
        return Answer(200, {"written": [e.eid for e, _ in written], "group_size": len(written)})

    def _write(self, write: _Write, what: str) -> None:
        """Hand the write to the feedback writer and wait for its commit (``serve.feedback_timeout_s``). One
        that is not committed by then may still be: it stays with the writer (a retry waits for it and answers
        from its receipt, or finds the response pending again once the writer gave up)."""
        with self._writes_ready:
            self._writes.append(write)
            self._writes_ready.notify_all()
        if not write.done.wait(self.settings.feedback_timeout_s):
            self.c_feedback.labels("failed").inc()
            raise _StillWriting(503, f"{what} is not committed after {self.settings.feedback_timeout_s:.0f}s "
                                     "(serve.feedback_timeout_s); send the feedback again: it is never written twice")
        if write.error is not None:
            self.c_feedback.labels("failed").inc()
            raise FeedbackError(503, f"could not write {what} (the server's log says why); send the feedback again")
        self.c_feedback.labels("written").inc(len(write.experiences))

    def _experience(self, pending: Pending, reward: float, group: str, size: int,
                    index: int) -> tuple[Experience, FeedbackReceipt]:
        c = pending.completion
        sample = WorkflowSample(tokens=list(c.prompt_ids) + list(c.response_ids), prompt_length=len(c.prompt_ids),
                                logprobs=list(c.logprobs), reward=reward, truncated=c.truncated,
                                response_text=c.text, model_version=c.model_version)
        sample.validate()
        experience = sample.to_experience(eid=f"{pending.request_id}/{pending.choice}", group_id=group,
                                          task_id=pending.request_id, step=c.model_version,
                                          kind=RolloutKind.TRAIN, run_index=index, worker_id=self.server_id)
        experience.group_size = size
        receipt = FeedbackReceipt(response_id=pending.request_id, choice=pending.choice, reward=reward,
                                  eid=experience.eid, group_id=group, group_size=size, run_index=index,
                                  model_version=c.model_version, server_id=self.server_id)
        return experience, receipt

    def _refused(self) -> None:
        self.c_feedback.labels("refused").inc()

    # -- the writer's side (its own thread) ------------------------------------------------------------------
    def take_writes(self) -> list[_Write]:
        with self._writes_ready:
            if not self._writes and not self.stop.requested:
                self._writes_ready.wait(RECEIPT_POLL_S)
            writes, self._writes = list(self._writes), deque()
        return writes


    def wake(self) -> None:
        """Let a writer waiting for feedback see the stop at once."""
        with self._writes_ready:
            self._writes_ready.notify_all()


class FeedbackWriter:
    """The feedback writer's loop (a role loop of its own): every feedback waiting, with its receipt, in one
    transaction per pass; and the receipts other servers write, read as they come (``read_receipts``)."""

    def __init__(self, desk: FeedbackDesk, config: RunConfig, read_receipts: Callable[[], None]) -> None:
        self.desk = desk
        self.config = config
        self.read_receipts = read_receipts

    def start(self, unit: UnitOfWork) -> None:
        pass

    def handle(self, unit: UnitOfWork) -> bool:
        desk = self.desk
        self.read_receipts()
        writes = desk.take_writes()
        if not writes:
            return True
        for write in writes:
            for experience in write.experiences:
                unit.produce(self.config.topic("experiences"), experience)
            for receipt in write.receipts:
                unit.produce(self.config.topic("feedback"), receipt)
        unit.describe(f"{sum(len(w.experiences) for w in writes)} feedback experience(s)")
        try:
            unit.commit()  # here rather than in the loop: a failed commit fails its feedback calls, not the server
        except BaseException as exc:
            unit.discard()
            for write in writes:
                write.finish(exc)
            if isinstance(exc, FatalTransactionError):
                raise
            logger.error("%s: %d feedback write(s) failed (%s); their callers are told to send them again",
                         desk.server_id, len(writes), exc)
            return True
        for write in writes:
            for receipt in write.receipts:
                desk.receipts.add(receipt)
            write.finish()
        return True

    def finish(self, unit: UnitOfWork) -> None:
        for write in self.desk.take_writes():
            write.finish(RuntimeError("the server is stopping"))
