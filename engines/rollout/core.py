"""The rollout core: rollout requests in, finished requests out, on one inference engine — no Kafka in here (the
rollout worker, ``consumers/rollout/``, reads requests from ``rollouts`` and commits what comes out; this is
what vLLM's engine is to its API server). Its four calls:

- :meth:`RolloutCore.add` a request that was read (it waits in the backlog, in the order read);
- :meth:`RolloutCore.step` asks the scheduler (``scheduler.py``, which has the admission rules) for a plan,
  carries it out (requests done at once, requests started, a swap), steps the engine once (continuous batching
  through a :class:`~streamrft.engines.workflows.WorkflowPool`), and hands back the requests that are done. It
  never waits for a version: a plan that waits says so, and the next step asks again;
- :meth:`RolloutCore.abort` drops requests that are no longer this worker's (a rebalance took their partition);
- weights change between engine steps. ``weight_update: drain``: only on a drained engine (a request that needs
  a version the engine does not serve stops admission until nothing runs, then the core swaps, so no sample
  mixes two versions). ``in_flight``: at once, between two engine steps, while requests run; their samples go on
  with the new weights (each records from which token: ``Completion.version_switches``; its first version is
  its ``model_version``, from which staleness counts), so neither a sync nor a request's version waits for the
  slowest sample of the batch (PipelineRL's in-flight updates). An engine that cannot load while its calls
  run (vLLM built without ``in_flight_weights``) is drained anyway. A batch engine (one step runs its calls
  whole) has nothing running between steps: in flight, it swaps between the turns of a multi-turn request.

A request whose workflow breaks the engine (its prompt, say) fails alone ("workflow-error").
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from streamrft.engines.settings.limits import WorkLimits
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus

from ..inference.base import InferenceEngine, SamplingParams
from ..workflows.base import WorkflowError, WorkflowSample
from ..workflows.scheduler import WorkflowPool
from .scheduler import (DEADLINE_ERROR, Plan, RolloutPolicy, RolloutScheduler, SchedulerState, Verdict, VersionWait,
                        WeightsState)

logger = logging.getLogger(__name__)


class Weights(WeightsState, Protocol):
    """What the core asks of whoever follows the published weights (the rollout worker's WeightFollower and
    its view of ``sync``): the scheduler's questions, and the one call that loads. Every call runs on the core's
    thread, while no workflow runs when it loads."""

    def swap_to_latest(self) -> bool:
        """Load the newest version, if it is due; True if the engine serves new weights. Called between engine
        steps, on a drained engine unless the policy updates in flight."""


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


class RolloutCore:
    def __init__(self, engine: InferenceEngine, weights: Weights, policy: RolloutPolicy,
                 limits: WorkLimits | None = None, *, stopped: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        """``stopped()``: a stop was requested (a version wait gives up, and the backlog is dropped: nothing of
        it was committed, so whoever reads the partitions next does it). ``clock``: what durations and version
        waits are measured on; ``wall_clock``: epoch seconds, what deadlines are."""
        self.engine = engine
        self.weights = weights
        self.policy = policy
        self.limits = limits or WorkLimits()
        self.scheduler = RolloutScheduler(policy, self.limits)
        self.stopped = stopped
        self.clock = clock
        self.wall_clock = wall_clock
        self.pool = WorkflowPool(engine, self.limits)
        self._backlog: list[tuple[Hashable, RolloutRequest, SamplingParams]] = []
        self._running: dict[Hashable, _Running] = {}
        self._done: list[Done] = []
        self.version_wait: VersionWait | None = None  # the last plan's: admission waits for this version
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
        """Plan and carry the plan out, step the engine once (waiting up to ``timeout`` for it to have work; no
        wait while requests wait for room), collect; hand back what is done, in the order it was done."""
        for _ in range(2):  # new weights may serve what waits: plan once more after a swap
            plan = self.scheduler.plan(self._state(cancelled_step))
            if not self._carry_out(plan):
                break
        if plan.wait is not None and plan.wait != self.version_wait:
            logger.info("admission waits for weights v%d (the engine serves v%d; at most %.0fs, "
                        "limits.max_version_wait_s)", plan.wait.version, self.engine.version,
                        self.policy.max_version_wait_s)
        self.version_wait = plan.wait
        if self.version_wait is not None and self.stopped():
            self._backlog.clear()  # nothing of it is committed: redelivered to whoever takes the partitions
            self.version_wait = None
        waiting_for_room = bool(self._backlog) and self.policy.batching == "continuous" and not self.version_wait
        started, running = self.clock(), self.pool.running
        finished = self.pool.drive(timeout=0.0 if waiting_for_room else timeout)
        if running:
            self.busy_s += self.clock() - started
        for key, output in finished:
            entry = self._running.pop(key)
            if isinstance(output, WorkflowError):
                self._finish(key, entry, RolloutStatus.FAILED, error=f"{output}\n{output.cause_traceback}",
                             reason="workflow-error")
            else:
                self._finish(key, entry, RolloutStatus.OK, samples=output)
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

    # -- carrying out a plan -------------------------------------------------------------------------------
    def _state(self, cancelled_step: int) -> SchedulerState:
        return SchedulerState(
            backlog=[(key, request) for key, request, _ in self._backlog],
            running={key: entry.request for key, entry in self._running.items()}, workflows=self.pool.running,
            weights=self.weights, engine_version=self.engine.version, engine_busy=bool(self.engine.unfinished),
            loads_in_flight=self.engine.loads_in_flight, cancelled_step=cancelled_step, now=self.clock(),
            now_ms=int(self.wall_clock() * 1000), wait=self.version_wait)

    def _carry_out(self, plan: Plan) -> bool:
        """Everything ``plan`` says, in its order; True if it swapped to new weights."""
        waiting = {key: (request, sampling) for key, request, sampling in self._backlog}
        for verdict in plan.finish:
            request, _ = waiting.pop(verdict.key)
            self._done.append(self._at_once(verdict, request))
        self._stop(plan.stop)
        for key in plan.admit:
            request, sampling = waiting.pop(key)
            self._running[key] = _Running(request, self.clock())
            self.pool.start(key, request.task, request.repeat_times, sampling,
                            greedy_baseline=self.policy.greedy_baseline and request.kind == RolloutKind.TRAIN)
        self._backlog = [entry for entry in self._backlog if entry[0] in waiting]
        return plan.swap and self._swap_to_latest()

    def _swap_to_latest(self) -> bool:
        running = self.pool.running
        swapped = self.weights.swap_to_latest()
        if swapped and running:
            self.swaps_in_flight += 1
        return swapped

    def _stop(self, late: list[Hashable]) -> None:
        """Running requests past their deadline are stopped and done TIMEOUT; what they sampled so far is dropped.
        (An engine call that is running finishes first: the transformers engine generates a call whole, vLLM
        stops it at its next step.)"""
        if not late:
            return
        self.pool.cancel(set(late))
        for key in late:
            entry = self._running.pop(key)
            self._warn_late(entry.request)
            self._finish(key, entry, RolloutStatus.TIMEOUT, error=DEADLINE_ERROR)

    # -- what is done --------------------------------------------------------------------------------------
    def _finish(self, key: Hashable, entry: _Running, status: RolloutStatus, **details) -> None:
        self._done.append(Done(key, entry.request, status, self.engine.version,
                               duration_s=self.clock() - entry.started, **details))

    def _at_once(self, verdict: Verdict, request: RolloutRequest) -> Done:
        if verdict.status == RolloutStatus.TIMEOUT:
            self._warn_late(request)
        return Done(verdict.key, request, verdict.status, self.engine.version, error=verdict.error,
                    reason=verdict.reason)

    def _warn_late(self, request: RolloutRequest) -> None:
        late_ms = int(self.wall_clock() * 1000) - (request.deadline_ms or 0)
        logger.warning("request %s (step %d) stopped %d ms past its deadline (rollout.task_timeout_s)",
                       request.request_id, request.step, late_ms)
