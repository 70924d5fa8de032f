"""Serve mode's feedback bookkeeping, no Kafka in here: completions waiting for feedback (bounded, expiring, each
taken once), which GRPO group a rewarded response joins, conversations held until they end, and the receipts of
what was written (so that a feedback sent again is answered the same and writes nothing twice)."""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from streamrft.engines.inference import Completion
from streamrft.schemas import FeedbackReceipt


class FeedbackError(Exception):
    """A feedback that cannot be used; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Pending:
    completion: Completion
    request_id: str
    choice: int
    choices: int
    created: float
    conversation: str | None = None
    per_prompt: int | None = None  # choices of each prompt of a batch request (None: one prompt, all choices)


class PendingExperiences:
    """Completions waiting for feedback: bounded (the oldest go first) and expiring; each is taken once."""

    def __init__(self, ttl_s: float, capacity: int, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.clock = clock
        self._items: OrderedDict[tuple[str, int], Pending] = OrderedDict()
        self._taken: OrderedDict[tuple[str, int], None] = OrderedDict()  # to tell "already rewarded" from unknown
        self.expired = 0
        self.evicted = 0
        self._lock = threading.Lock()

    def add(self, request_id: str, completions: list[Completion], conversation: str | None = None,
            per_prompt: int | None = None) -> None:
        """The choices of one response; of a batch of prompts, ``per_prompt`` choices each, prompt-major."""
        now = self.clock()
        batch = per_prompt if per_prompt is not None and per_prompt != len(completions) else None
        with self._lock:
            self._expire(now)
            for i, completion in enumerate(completions):
                self._items[(request_id, i)] = Pending(completion, request_id, i, len(completions), now,
                                                       conversation, batch)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
                self.evicted += 1

    def take(self, request_id: str, choice: int) -> Pending:
        with self._lock:
            self._expire(self.clock())
            key = (request_id, choice)
            if key in self._taken:
                raise FeedbackError(409, f"response {request_id} choice {choice} has had its feedback already")
            pending = self._items.pop(key, None)
            if pending is None:
                raise FeedbackError(404, f"no pending response {request_id} choice {choice}: unknown, or older "
                                         "than serve.pending_ttl_s")
            self._taken[key] = None
            while len(self._taken) > self.capacity:
                self._taken.popitem(last=False)
            return pending

    def give_back(self, pending: Pending) -> None:
        """A feedback whose experience could not be written: it may be sent again."""
        with self._lock:
            key = (pending.request_id, pending.choice)
            self._taken.pop(key, None)
            self._items[key] = pending

    def _expire(self, now: float) -> None:
        while self._items:
            key, oldest = next(iter(self._items.items()))
            if now - oldest.created < self.ttl_s:
                break
            del self._items[key]
            self.expired += 1

    def __len__(self) -> int:
        return len(self._items)


class Grouping:
    """Which GRPO group a rewarded response joins (see the module docstring)."""

    def __init__(self, kind: str, group_size: int, session: str) -> None:
        self.kind = kind
        self.group_size = group_size
        self.session = session
        self._count = itertools.count()
        self._members: dict[str, int] = {}
        self._lock = threading.Lock()

    def assign(self, pending: Pending, group_id: str | None, group_size: int | None) -> tuple[str, int, int]:
        """``(group_id, group_size, run_index)``."""
        if self.kind == "request":  # the choices of one prompt (a batch request has several prompts)
            if pending.per_prompt is not None:
                prompt, index = divmod(pending.choice, pending.per_prompt)
                return f"{pending.request_id}.p{prompt}", pending.per_prompt, index
            return pending.request_id, pending.choices, pending.choice
        with self._lock:
            if self.kind == "count":
                n = next(self._count)
                return f"{self.session}-g{n // self.group_size}", self.group_size, n % self.group_size
            if not group_id or not group_size or group_size < 1:
                raise FeedbackError(400, "serve.grouping is client: the feedback must name group_id and "
                                         "group_size >= 1")
            index = self._members.get(group_id, 0)
            if index >= group_size:
                raise FeedbackError(409, f"group {group_id} has its {group_size} responses already")
            self._members[group_id] = index + 1
            return group_id, group_size, index


class Conversations:
    """``serve.grouping: conversation``: the rewarded responses of each open conversation, until it ends (then
    they are written as one group) or expires (``ttl_s`` after its latest feedback)."""

    def __init__(self, ttl_s: float, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._open: OrderedDict[str, tuple[float, list[tuple[Pending, float]]]] = OrderedDict()
        self.expired = 0  # responses of conversations that never ended
        self._lock = threading.Lock()

    def add(self, pending: Pending, reward: float) -> int:
        """Hold a rewarded response; returns how many its conversation holds now."""
        with self._lock:
            self._expire()
            _, held = self._open.pop(pending.conversation, (0.0, []))
            held.append((pending, reward))
            self._open[pending.conversation] = (self.clock(), held)
            return len(held)

    def end(self, conversation: str) -> list[tuple[Pending, float]]:
        with self._lock:
            _, held = self._open.pop(conversation, (0.0, []))
            return held

    def give_back(self, conversation: str, held: list[tuple[Pending, float]]) -> None:
        """An ended conversation whose experiences could not be written: it stays open, to be ended again."""
        with self._lock:
            self._open[conversation] = (self.clock(), held)

    def _expire(self) -> None:
        now = self.clock()
        while self._open:
            conversation, (last, held) = next(iter(self._open.items()))
            if now - last < self.ttl_s:
                break
            del self._open[conversation]
            self.expired += len(held)

    def __len__(self) -> int:
        return sum(len(held) for _, held in self._open.values())


class Receipts:
    """What each acknowledged feedback wrote, by (response id, choice): this server's own, and every other
    server's read from the ``feedback`` topic. Bounded: the oldest are forgotten first (a retry comes within
    seconds or minutes, ``capacity`` is the pending store's)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, int], FeedbackReceipt] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, receipt: FeedbackReceipt) -> None:
        with self._lock:
            self._items[(receipt.response_id, receipt.choice)] = receipt
            self._items.move_to_end((receipt.response_id, receipt.choice))
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, choice: int) -> FeedbackReceipt | None:
        with self._lock:
            return self._items.get((response_id, choice))

    def __len__(self) -> int:
        return len(self._items)
