"""The rollout scheduler: which requests start, which are done at once, when the weights change. Like vLLM v1's
scheduler it is a pure function of state: :meth:`RolloutScheduler.plan` reads a :class:`SchedulerState` and
returns a :class:`Plan`, which the rollout core (``core.py``) carries out. Nothing here blocks, sleeps or does
I/O. Waiting for a version is a state, :class:`VersionWait`, that a plan hands back and the next call is given:
the loop around the core goes on polling, heart-beating and committing meanwhile.

Admission, in the order the requests were read (each check of the rollout worker's numbered steps):
1. a training request of a step the explorer cancelled is done at once, CANCELLED (over-rollout); one past its
   deadline (``RolloutRequest.deadline_ms``) is done TIMEOUT;
2. a request asking for more than the limits allow (``max_repeat_times``) FAILS with the reason ("over-limit");
3. continuous batching admits up to ``requests_in_flight`` requests at once; ``batch`` admits a whole batch at a
   time, only onto an idle engine;
4. weights: the engine must serve at least the request's ``min_model_version`` and, when the policy follows the
   latest version (``fully_async``), the newest published one; else the plan swaps to the newest version (in
   flight, or once the engine is drained: ``weight_update``) and the core plans again. A version not published
   yet is waited for only once nothing runs (in flight, the running requests go on meanwhile): the request, and
   those read after it, stay in the backlog, and after ``max_version_wait_s`` of waiting, what still cannot be
   served FAILS ("version-wait"), as does at once a request whose version was refused;
5. the request's workflow starts, ``repeat_times`` samples. A running request past its deadline is stopped and
   done TIMEOUT.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from streamrft.engines.settings.limits import WorkLimits
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus


DEADLINE_ERROR = "past its deadline (rollout.task_timeout_s)"


class WeightsState(Protocol):
    """What the scheduler asks of whoever follows the published weights: questions only, answered from what was
    read already."""

    @property
    def published(self) -> int:
        """The newest version the trainer published (0: none yet)."""

    def serves(self, minimum: int) -> bool:
        """The engine serves at least ``minimum`` (of the trainer's current lineage)."""

    def newer_due(self) -> bool:
        """A newer version is published and may be loaded now."""

    def refused(self, minimum: int) -> bool:
        """The newest published version, which would serve ``minimum``, was refused for good: waiting is
        pointless."""


@dataclass(frozen=True)
class RolloutPolicy:
    """How the core admits and swaps (``rollout.batching``, ``rollout.requests_in_flight``,
    ``rollout.requests_per_batch``, ``Pacing.follows_latest``, ``limits.max_version_wait_s``), and what a
    training request's workflow runs besides its samples (``greedy_baseline``: ReMax's greedy sample, derived
    from ``trainer.algorithm.advantage: remax``)."""

    batching: Literal["continuous", "batch"] = "continuous"
    requests_in_flight: int = 16
    requests_per_batch: int = 8
    follows_latest: bool = False
    max_version_wait_s: float = 600.0
    weight_update: Literal["drain", "in_flight"] = "drain"
    greedy_baseline: bool = False


@dataclass(frozen=True)
class VersionWait:
    """Admission waits for weights ``version`` since ``since`` (seconds, on the clock of ``SchedulerState.now``)."""

    version: int
    since: float


@dataclass(frozen=True)
class Verdict:
    """A request done without running: CANCELLED, TIMEOUT, or FAILED with ``reason`` and ``error``."""

    key: Hashable
    status: RolloutStatus
    reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class SchedulerState:
    """What one plan is made from."""

    backlog: Sequence[tuple[Hashable, RolloutRequest]]  # read and not started, in the order read
    running: Mapping[Hashable, RolloutRequest]  # started and not done
    workflows: int  # workflows running, those of aborted requests winding down included
    weights: WeightsState
    engine_version: int
    engine_busy: bool  # the engine holds unfinished calls
    loads_in_flight: bool  # the engine can load weights under running calls
    cancelled_step: int  # the explorer's newest cancelled step
    now: float  # seconds, monotonic: what a version wait is measured on
    now_ms: int  # epoch milliseconds: what deadlines are
    wait: VersionWait | None = None  # the previous plan's


@dataclass
class Plan:
    """What the core does now, in this order: ``finish`` (in the order read), ``stop``, ``admit`` (in the order
    read), then ``swap``, after which it plans again (new weights may serve what waits). ``wait``: admission
    waits for a version, to be handed to the next plan."""

    admit: list[Hashable] = field(default_factory=list)
    finish: list[Verdict] = field(default_factory=list)
    stop: list[Hashable] = field(default_factory=list)  # running requests past their deadline: done TIMEOUT
    swap: bool = False  # load the newest published version
    wait: VersionWait | None = None

    def finished(self, status: RolloutStatus) -> list[Hashable]:
        return [verdict.key for verdict in self.finish if verdict.status == status]


def past(deadline_ms: int | None, now_ms: int) -> bool:
    """Whether a request's deadline (epoch milliseconds, set by the explorer) has passed."""
    return bool(deadline_ms) and now_ms >= deadline_ms


class RolloutScheduler:
    def __init__(self, policy: RolloutPolicy, limits: WorkLimits | None = None) -> None:
        self.policy = policy
        self.limits = limits or WorkLimits()

    def plan(self, state: SchedulerState) -> Plan:
        """The plan for ``state`` (the module docstring's 1.-5.)."""
        plan = Plan(stop=[key for key, request in state.running.items() if past(request.deadline_ms, state.now_ms)])
        running = state.workflows
        if self.policy.follows_latest and state.weights.newer_due() and self._may_swap(state, running):
            plan.swap = True  # admission follows once the newest version is loaded
            return plan
        if self.policy.batching == "batch" and running:
            return plan  # a batch is admitted whole, onto an idle engine
        failed: set[Hashable] = set()
        for position, (key, request) in enumerate(state.backlog):
            if key in failed:
                continue
            if request.kind == RolloutKind.TRAIN and request.step <= state.cancelled_step:  # 1.
                plan.finish.append(Verdict(key, RolloutStatus.CANCELLED))
            elif past(request.deadline_ms, state.now_ms):
                plan.finish.append(Verdict(key, RolloutStatus.TIMEOUT, error=DEADLINE_ERROR))
            elif (why := self._over_limit(request)) is not None:  # 2.
                plan.finish.append(Verdict(key, RolloutStatus.FAILED, reason="over-limit", error=why))
            elif self.policy.batching == "continuous" and running >= self.policy.requests_in_flight:
                break  # 3. the engine is full; this one waits for the next request to finish
            elif self._needs_swap(state, request):  # 4.
                if not self._may_swap(state, running):
                    break  # drain first: the weights change only while nothing runs
                if state.weights.newer_due():
                    plan.swap = True
                    break
                if running:
                    break  # in flight: a version not published yet is waited for only once nothing runs
                late = self._version_wait(state, request, state.backlog[position:], plan)
                if not late:
                    break
                plan.finish += late
                failed |= {verdict.key for verdict in late}
            else:  # 5.
                plan.admit.append(key)
                running += 1
        return plan

    def _over_limit(self, request: RolloutRequest) -> str | None:
        try:
            self.limits.check_repeat_times(request.repeat_times)
        except ValueError as exc:
            return str(exc)
        return None

    def _may_swap(self, state: SchedulerState, running: int) -> bool:
        """Whether new weights may load now: on a drained engine, or in flight when the engine can."""
        if not running:
            return True
        return self.policy.weight_update == "in_flight" and (state.loads_in_flight or not state.engine_busy)

    def _needs_swap(self, state: SchedulerState, request: RolloutRequest) -> bool:
        if not state.weights.serves(request.min_model_version):
            return True
        return self.policy.follows_latest and state.weights.newer_due()

    def _version_wait(self, state: SchedulerState, request: RolloutRequest,
                      rest: Sequence[tuple[Hashable, RolloutRequest]], plan: Plan) -> list[Verdict]:
        """The engine is drained and nothing it can load serves ``request`` (``rest[0]``): wait (``plan.wait``,
        and nothing to hand back), or, once the wait is over or the version was refused, FAIL it and every request
        after it that needs more than the engine serves."""
        needed, wait_s = request.min_model_version, self.policy.max_version_wait_s
        published = state.weights.published
        if state.weights.refused(needed):
            why = (f"weights v{needed} were needed; the newest published (v{published}) was refused, so this "
                   f"worker serves v{state.engine_version}")
        else:
            wait = state.wait if state.wait is not None and state.wait.version == needed else None
            wait = wait or VersionWait(needed, state.now)
            if state.now - wait.since < wait_s:
                plan.wait = wait
                return []
            why = (f"weights v{needed} were needed; after {wait_s:.0f}s (limits.max_version_wait_s) this worker "
                   f"serves v{state.engine_version} (the newest published is v{published})")
        (first, _), after = rest[0], rest[1:]
        late = [first] + [key for key, other in after if other.min_model_version > state.engine_version]
        return [Verdict(key, RolloutStatus.FAILED, reason="version-wait", error=why) for key in late]
