"""The rollout core: rollout requests in, finished requests out, on one inference engine — no Kafka in here (the
rollout worker, ``consumers/rollout.py``, reads requests from ``rollouts`` and commits what comes out; this is
what vLLM's engine is to its API server). Its four calls:

- :meth:`RolloutCore.add` a request that was read (it waits in the backlog, in the order read);
- :meth:`RolloutCore.step` admits what can start, steps the engine once (continuous batching through a
  :class:`~streamrft.engines.workflows.WorkflowPool`), and hands back the requests that are done;
- :meth:`RolloutCore.abort` drops requests that are no longer this worker's (a rebalance took their partition);
- weights change between engine steps. ``weight_update: drain``: only on a drained engine (a request that needs
  a version the engine does not serve stops admission until nothing runs, then the core swaps, so no sample
  mixes two versions). ``in_flight``: at once, between two engine steps, while requests run; their samples go on
  with the new weights (each records from which token: ``Completion.version_switches``; its first version is
  its ``model_version``, from which staleness counts), so neither a sync nor a request's version waits for the
  slowest sample of the batch (PipelineRL's in-flight updates). An engine that cannot load while its calls
  run (vLLM built without ``in_flight_weights``) is drained anyway. A batch engine (one step runs its calls
  whole) has nothing running between steps: in flight, it swaps between the turns of a multi-turn request.

Admission, in the order the requests were read (each check of the rollout worker's numbered steps):
1. a training request of a step the explorer cancelled is done at once, CANCELLED (over-rollout); one past its
   deadline (``RolloutRequest.deadline_ms``) is done TIMEOUT;
2. a request asking for more than the limits allow (``max_repeat_times``) FAILS with the reason ("over-limit");
3. continuous batching admits up to ``requests_in_flight`` requests at once; ``batch`` admits a whole batch at a
   time, only onto an idle engine;
4. weights: the engine must serve at least the request's ``min_model_version`` and, when the policy follows the
   latest version (``fully_async``), the newest published one; else the core swaps (in flight, or once the
   engine is drained), waiting at most ``max_version_wait_s`` for a version not published yet (in flight: only
   once nothing runs, the running requests going on meanwhile); what still cannot be served FAILS
   ("version-wait");
5. the request's workflow starts, ``repeat_times`` samples; one whose prompt breaks the engine fails alone
   ("workflow-error"). A running request past its deadline is stopped and done TIMEOUT (its samples dropped).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus

from ..inference.base import InferenceEngine, SamplingParams
from ..workflows.base import WorkflowError, WorkflowSample
from ..workflows.limits import WorkLimits
from ..workflows.scheduler import WorkflowPool

logger = logging.getLogger(__name__)


class Weights(Protocol):
    """What the core asks of whoever follows the published weights (the rollout worker's WeightFollower and
    its view of ``sync``). Every call runs on the core's thread, while no workflow runs when it loads."""

    @property
    def published(self) -> int:
        """The newest version the trainer published (0: none yet)."""

    def serves(self, minimum: int) -> bool:
        """The engine serves at least ``minimum`` (of the trainer's current lineage)."""

    def newer_due(self) -> bool:
        """A newer version is published and may be loaded now."""

    def swap_to_latest(self) -> bool:
        """Load the newest version, if it is due; True if the engine serves new weights. Called between engine
        steps, on a drained engine unless the policy updates in flight."""

    def ensure(self, minimum: int, timeout_s: float) -> bool:
        """Wait (following the signals) until the engine serves at least ``minimum``; False on timeout, on a
        stop, or when that version was refused."""


@dataclass(frozen=True)
class RolloutPolicy:
    """How the core admits and swaps (``rollout.batching``, ``rollout.requests_in_flight``,
    ``rollout.requests_per_batch``, ``Pacing.follows_latest``, ``limits.max_version_wait_s``)."""

    batching: Literal["continuous", "batch"] = "continuous"
    requests_in_flight: int = 16
    requests_per_batch: int = 8
    follows_latest: bool = False
    max_version_wait_s: float = 600.0
    weight_update: Literal["drain", "in_flight"] = "drain"


@dataclass
class Done:
    """A request the core is finished with. ``status`` OK: ``samples`` hold its scored samples; FAILED:
    ``reason`` (over-limit, version-wait, workflow-error) and ``error`` say why; CANCELLED / TIMEOUT: nothing ran
    to the end. ``version``: the weights the engine served when it finished."""

    key: Hashable
    request: RolloutRequest
    status: RolloutStatus
    version: int
    samples: list[WorkflowSample] = field(default_factory=list)
    error: str | None = None
    reason: str | None = None
    duration_s: float = 0.0


@dataclass
class _Running:
    request: RolloutRequest
    started: float


def _past(deadline_ms: int | None) -> bool:
    """Whether a request's deadline (epoch milliseconds, set by the explorer) has passed."""
    return bool(deadline_ms) and time.time() * 1000 >= deadline_ms


class RolloutCore:
    def __init__(self, engine: InferenceEngine, weights: Weights, policy: RolloutPolicy,
                 limits: WorkLimits | None = None, *, stopped: Callable[[], bool] = lambda: False) -> None:
        """``stopped()``: a stop was requested (a swap that is waiting gives up, and the backlog is dropped:
        nothing of it was committed, so whoever reads the partitions next does it)."""
        self.engine = engine
        self.weights = weights
        self.policy = policy
        self.limits = limits or WorkLimits()
        self.stopped = stopped
        self.pool = WorkflowPool(engine, self.limits)
        self._backlog: list[tuple[Hashable, RolloutRequest, SamplingParams]] = []
        self._running: dict[Hashable, _Running] = {}
        self._done: list[Done] = []
        self.busy_s = 0.0  # seconds the engine was stepped with requests in flight
        self.swaps_in_flight = 0  # versions loaded while requests ran

    # -- what the worker asks ------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self.pool.running

    @property
    def waiting(self) -> int:
        """Requests added and not started."""
        return len(self._backlog)

    @property
    def idle(self) -> bool:
        return not (self._backlog or self._running or self._done)

    def keys(self) -> list[Hashable]:
        """Every request the core holds, waiting or running."""
        return [key for key, _, _ in self._backlog] + list(self._running)

    def add(self, key: Hashable, request: RolloutRequest, sampling: SamplingParams) -> None:
        """Queue a request under ``key`` (unique among what the core holds)."""
        self._backlog.append((key, request, sampling))

    def step(self, cancelled_step: int, timeout: float = 0.05) -> list[Done]:
        """Admit, step the engine once (waiting up to ``timeout`` for it to have work; no wait while requests
        wait for room), collect; hand back what is done, in the order it was done."""
        if self.policy.follows_latest and self._may_swap():
            self._swap_to_latest()
        self._admit(cancelled_step)
        waiting_for_room = bool(self._backlog) and self.policy.batching == "continuous"
        started, running = time.monotonic(), self.pool.running
        finished = self.pool.drive(timeout=0.0 if waiting_for_room else timeout)
        if running:
            self.busy_s += time.monotonic() - started
        for key, output in finished:
            entry = self._running.pop(key)
            if isinstance(output, WorkflowError):
                self._finish(key, entry, RolloutStatus.FAILED, error=f"{output}\n{output.cause_traceback}",
                             reason="workflow-error")
            else:
                self._finish(key, entry, RolloutStatus.OK, samples=output)
        self._stop_late()
        done, self._done = self._done, []
        return done

    def abort(self, keys: Iterable[Hashable]) -> None:
        """Forget these requests, waiting or running (their workflows stop at their next engine call); nothing
        is handed back for them."""
        dropped = set(keys)
        self._backlog = [entry for entry in self._backlog if entry[0] not in dropped]
        running = dropped & set(self._running)
        self.pool.cancel(running)
        for key in running:
            del self._running[key]
        self._done = [done for done in self._done if done.key not in dropped]

    def close(self) -> None:
        self.pool.close()

    # -- admission (the module docstring's 1.-5.) ----------------------------------------------------------
    def _admit(self, cancelled_step: int) -> None:
        if self.policy.batching == "batch" and self.pool.running:
            return  # a batch is admitted whole, onto an idle engine
        while self._backlog:
            key, request, sampling = self._backlog[0]
            if request.kind == RolloutKind.TRAIN and request.step <= cancelled_step:  # 1.
                self._done.append(self._at_once(key, request, RolloutStatus.CANCELLED))
            elif _past(request.deadline_ms):
                self._done.append(self._timed_out(key, request, 0.0))
            elif (why := self._over_limit(request)) is not None:  # 2.
                self._done.append(self._at_once(key, request, RolloutStatus.FAILED, error=why, reason="over-limit"))
            elif self.policy.batching == "continuous" and self.pool.running >= self.policy.requests_in_flight:
                return  # 3. the engine is full; this one waits for the next request to finish
            elif self._needs_swap(request):  # 4.
                if not self._may_swap():
                    return  # drain first: the weights change only while nothing runs
                if self.pool.running:  # in flight: what is published now; waiting for more only on an idle engine
                    self._swap_to_latest()
                    if not self.weights.serves(request.min_model_version):
                        return
                    continue
                self._swap_for(request)
                continue
            else:  # 5.
                self._running[key] = _Running(request, time.monotonic())
                self.pool.start(key, request.task, request.repeat_times, sampling)
            self._backlog.pop(0)

    def _over_limit(self, request: RolloutRequest) -> str | None:
        try:
            self.limits.check_repeat_times(request.repeat_times)
        except ValueError as exc:
            return str(exc)
        return None

    def _may_swap(self) -> bool:
        """Whether new weights may load now: on a drained engine, or in flight when the engine can."""
        if not self.pool.running:
            return True
        return self.policy.weight_update == "in_flight" and (self.engine.loads_in_flight
                                                             or not self.engine.unfinished)

    def _swap_to_latest(self) -> None:
        running = self.pool.running
        if self.weights.swap_to_latest() and running:
            self.swaps_in_flight += 1

    def _needs_swap(self, request: RolloutRequest) -> bool:
        if not self.weights.serves(request.min_model_version):
            return True
        return self.policy.follows_latest and self.weights.newer_due()

    def _swap_for(self, request: RolloutRequest) -> None:
        """The engine is drained: load the weights ``request`` needs (and the newest, when the policy follows
        it); what still cannot be served after ``max_version_wait_s`` FAILS with the reason."""
        if self.policy.follows_latest:
            self.weights.swap_to_latest()
        needed, wait_s = request.min_model_version, self.policy.max_version_wait_s
        if self.weights.ensure(needed, wait_s):
            return
        if self.stopped():
            self._backlog.clear()  # nothing of it is committed: redelivered to whoever takes the partitions
            return
        why = (f"weights v{needed} were needed; after {wait_s:.0f}s (limits.max_version_wait_s) this worker "
               f"serves v{self.engine.version} (the newest published is v{self.weights.published})")
        late = [entry for entry in self._backlog if entry[1].min_model_version > self.engine.version]
        for key, late_request, _ in late:
            self._done.append(self._at_once(key, late_request, RolloutStatus.FAILED, error=why,
                                            reason="version-wait"))
        self._backlog = [entry for entry in self._backlog if entry not in late]

    # -- what is done --------------------------------------------------------------------------------------
    def _stop_late(self) -> None:
        """Requests past their deadline are stopped and done TIMEOUT; what they sampled so far is dropped. (An
        engine call that is running finishes first: the transformers engine generates a call whole, vLLM stops
        it at its next step.)"""
        late = {key for key, entry in self._running.items() if _past(entry.request.deadline_ms)}
        if not late:
            return
        self.pool.cancel(late)
        for key in late:
            entry = self._running.pop(key)
            self._done.append(self._timed_out(key, entry.request, time.monotonic() - entry.started))

    def _finish(self, key: Hashable, entry: _Running, status: RolloutStatus, **details) -> None:
        self._done.append(Done(key, entry.request, status, self.engine.version,
                               duration_s=time.monotonic() - entry.started, **details))

    def _at_once(self, key: Hashable, request: RolloutRequest, status: RolloutStatus, **details) -> Done:
        return Done(key, request, status, self.engine.version, **details)

    def _timed_out(self, key: Hashable, request: RolloutRequest, duration_s: float) -> Done:
        late_ms = int(time.time() * 1000) - (request.deadline_ms or 0)
        logger.warning("request %s (step %d) stopped %d ms past its deadline (rollout.task_timeout_s)",
                       request.request_id, request.step, late_ms)
        return Done(key, request, RolloutStatus.TIMEOUT, self.engine.version, error="past its deadline "
                    "(rollout.task_timeout_s)", duration_s=duration_s)
