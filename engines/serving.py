"""Many clients, one engine: the generation loop behind serve mode, with no Kafka and no HTTP in it.

Clients (HTTP handlers, on their own threads or event loop) :meth:`ServingLoop.submit` a :class:`Job` and wait
for it; one thread owns the engine and calls :meth:`ServingLoop.step`, which

1. swaps the weights when a new version is due and the engine is drained (admission pauses meanwhile, so no
   choice mixes two versions: its behaviour logprobs are one policy's, and its ``model_version`` says which);
2. admits waiting jobs into the running batch, up to ``max_running`` (an incremental engine such as vLLM takes
   them at its next scheduler step; a batch engine, the transformers one, takes every job waiting when its next
   step starts: with ``batch_window_s`` an idle engine waits that long for more to come);
3. steps the engine once; each job's listener hears its choices' new tokens as the engine produces them
   (streaming), and a job whose choices are all done gets its completions;
4. stops jobs past their deadline (``request_timeout_s``) and those their client gave up on (cancelled: a
   streaming client that disconnected); the engine drops their sequences.

Bounds: at most ``max_running`` jobs in the engine and ``max_waiting`` queued; a submit beyond that is refused
with :class:`Overloaded` (the HTTP side answers 429 with Retry-After) instead of queueing without bound.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .inference.base import Completion, InferenceEngine, Prompt, SamplingParams, TokenListener

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0


class Overloaded(RuntimeError):
    """The loop holds as many jobs as it may; ``retry_after_s``: when one is likely to have left."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JobStopped(RuntimeError):
    """The job ran past its deadline, or its client cancelled it; its completions are not handed back."""


class Weights(Protocol):
    def newer_due(self) -> bool:
        """A newer published version may be loaded now."""

    def swap_to_latest(self) -> bool:
        """Load it; True if the engine serves new weights."""


@dataclass(frozen=True)
class ServingPolicy:
    max_running: int = 64
    max_waiting: int = 64
    request_timeout_s: float = 120.0
    batch_window_s: float = 0.0


@dataclass(eq=False)
class Job:
    """One request: ``n`` choices of ``prompt``. ``on_tokens`` hears each choice's new tokens (the loop's
    thread); ``on_done(completions, error)`` is called once, with the completions or the error that stopped
    the job."""

    prompt: Prompt
    params: SamplingParams
    n: int
    on_done: Callable[[list[Completion] | None, BaseException | None], None]
    on_tokens: TokenListener | None = None
    submitted: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    cancelled: bool = False
    version: int | None = None  # the weights that generate it, once admitted

    def _finish(self, completions: list[Completion] | None, error: BaseException | None) -> None:
        try:
            self.on_done(completions, error)
        except Exception:  # a client's callback must not stop the loop
            logger.exception("serving: a job's completion callback failed")


def _listener(job: Job) -> TokenListener:
    """The engine's (prompt 0, sample j) as the job's choice j; answers False once nobody wants the job any more
    (its client went away, its deadline passed), so that an engine that can stops it mid-step."""

    def heard(_prompt: int, choice: int, ids: list[int], logprobs: list[float]) -> bool:
        if job.on_tokens is not None:
            job.on_tokens(0, choice, ids, logprobs)
        return not (job.cancelled or time.monotonic() >= job.deadline)

    return heard


class ServingLoop:
    def __init__(self, engine: InferenceEngine, weights: Weights, policy: ServingPolicy) -> None:
        self.engine = engine
        self.weights = weights
        self.policy = policy
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._keys = itertools.count()
        # what the loop did, for metrics
        self.steps = 0
        self.largest_batch = 0  # the most jobs one engine step has run together
        self.last_batch = 0
        self.cancelled = 0
        self.timed_out = 0
        self.refused = 0
        self.swaps = 0
        self.swap_pause_s = 0.0  # admission paused for a swap, the longest pause
        self._draining_since: float | None = None
        self._recent_s: deque[float] = deque(maxlen=32)  # how long recent jobs ran

    # -- the clients' side (any thread) ------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`Overloaded` when the loop holds its bound already."""
        with self._lock:
            if len(self._waiting) >= self.policy.max_waiting:
                self.refused += 1
                raise Overloaded(f"{len(self._running)} requests running and {len(self._waiting)} waiting "
                                 "(serve.max_running, serve.max_waiting)", self._retry_after_s())
            job.deadline = job.submitted + self.policy.request_timeout_s
            self._waiting.append(job)
            self._lock.notify_all()

    def cancel(self, job: Job) -> None:
        """The client gave up on ``job`` (a streaming client disconnected): it leaves the engine at the next
        step."""
        with self._lock:
            job.cancelled = True
            self._lock.notify_all()

    def _retry_after_s(self) -> float:
        """The median time recent requests took: by then one has likely left (1 s to MAX_RETRY_AFTER_S)."""
        typical = sorted(self._recent_s)[len(self._recent_s) // 2] if self._recent_s else 1.0
        return min(MAX_RETRY_AFTER_S, max(1.0, typical))

    # -- the engine's thread --------------------------------------------------------------------------------
    def step(self, timeout: float = 0.05) -> None:
        """1.-4. of the module docstring, once; waits up to ``timeout`` when there is nothing to do."""
        self._swap_when_drained()  # 1.
        self._admit(timeout)  # 2.
        if self._running:
            self._step_engine()  # 3.
        self._stop_late_and_cancelled()  # 4.

    def close(self) -> None:
        """Fail every job still held (the server is going away)."""
        with self._lock:
            jobs = [*self._waiting, *self._running.values()]
            self._waiting.clear()
        if self._running:
            self.engine.abort(list(self._running))
            self._running.clear()
        for job in jobs:
            job._finish(None, JobStopped("the server is stopping"))

    def _swap_when_drained(self) -> None:
        if self._draining_since is None:
            if not self.weights.newer_due():
                return
            self._draining_since = time.monotonic()
        if self._running:
            return  # admission is paused until the running jobs are done
        if self.weights.swap_to_latest():
            self.swaps += 1
        self.swap_pause_s = max(self.swap_pause_s, time.monotonic() - self._draining_since)
        self._draining_since = None

    def _admit(self, timeout: float) -> None:
        with self._lock:
            if not self._waiting and not self._running:
                self._lock.wait(timeout)
            if self._draining_since is not None or not self._waiting:
                return
            if not self._running and self.policy.batch_window_s and not self.engine.incremental:
                self._gather()
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.policy.max_running:
                job = self._waiting.popleft()
                if not job.cancelled:
                    admitted.append(job)
        for job in admitted:
            self._start(job)

    def _gather(self) -> None:
        """An idle batch engine: wait up to ``batch_window_s`` after the first job for others to join it (a
        batch engine runs a step whole, so one that comes later waits for the next step)."""
        until = time.monotonic() + self.policy.batch_window_s
        while len(self._waiting) < self.policy.max_running and (left := until - time.monotonic()) > 0:
            self._lock.wait(left)

    def _start(self, job: Job) -> None:
        key = next(self._keys)
        job.version = self.engine.version
        self._running[key] = job
        self.engine.submit(key, [job.prompt], job.params, job.n, on_tokens=_listener(job))

    def _step_engine(self) -> None:
        self.steps += 1
        self.last_batch = len(self._running)
        self.largest_batch = max(self.largest_batch, self.last_batch)
        try:
            finished = self.engine.step()
        except Exception as exc:  # the engine broke: every job it holds fails, the loop goes on
            logger.exception("serving: the engine failed a step; %d request(s) fail", len(self._running))
            jobs, self._running = list(self._running.values()), {}
            for job in jobs:
                job._finish(None, exc)
            return
        for key, result in finished:
            job = self._running.pop(key, None)
            if job is None:
                continue
            if job.cancelled or time.monotonic() >= job.deadline:  # stopped mid-step: see the next method
                self._running[key] = job
                continue
            self._recent_s.append(time.monotonic() - job.submitted)
            if isinstance(result, BaseException):
                job._finish(None, result)
            else:
                job._finish(result[0], None)

    def _stop_late_and_cancelled(self) -> None:
        now = time.monotonic()
        with self._lock:
            waiting_late = [j for j in self._waiting if j.cancelled or now >= j.deadline]
            for job in waiting_late:
                self._waiting.remove(job)
        stopped = {key: job for key, job in self._running.items() if job.cancelled or now >= job.deadline}
        if stopped:
            self.engine.abort(list(stopped))  # a call the engine handed back already is forgotten anyway
            for key in stopped:
                del self._running[key]
        for job in [*waiting_late, *stopped.values()]:
            if job.cancelled:
                self.cancelled += 1
                job._finish(None, JobStopped("the client cancelled the request"))
            else:
                self.timed_out += 1
                job._finish(None, JobStopped(f"not done {self.policy.request_timeout_s:.0f}s after it came "
                                             "(serve.request_timeout_s)"))
