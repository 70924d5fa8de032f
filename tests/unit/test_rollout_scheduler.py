"""The rollout scheduler's plans, each admission rule on its own: a pure function of state, so no engine, no
clock and no weights run here (engines/rollout/scheduler.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from streamrft.engines.rollout import RolloutPolicy, RolloutScheduler, SchedulerState, VersionWait
from streamrft.engines.settings.limits import WorkLimits
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus, Task

NOW_MS = 1_700_000_000_000


@dataclass
class Weights:
    """The weights side as the scheduler asks it: the engine serves ``served``; ``published`` may load now unless
    it was refused."""

    served: int = 0
    published: int = 0
    refused_versions: set[int] = field(default_factory=set)

    def serves(self, minimum: int) -> bool:
        return minimum <= self.served

    def newer_due(self) -> bool:
        return self.published > self.served and self.published not in self.refused_versions

    def refused(self, minimum: int) -> bool:
        return self.published >= minimum and self.published in self.refused_versions


def request(rid: str, *, step: int = 0, repeat: int = 2, min_version: int = 0, deadline_ms: int | None = None,
            kind: RolloutKind = RolloutKind.TRAIN) -> RolloutRequest:
    task = Task(task_id=rid, workflow="arithmetic", payload=json.dumps({"question": "1 + 1", "answer": "2"}))
    return RolloutRequest(request_id=rid, step=step, kind=kind, task=task, repeat_times=repeat,
                          min_model_version=min_version, deadline_ms=deadline_ms)


def state(*backlog: RolloutRequest, weights: Weights | None = None, running: tuple[RolloutRequest, ...] = (),
          cancelled_step: int = -1, now: float = 100.0, wait: VersionWait | None = None, busy: bool = False,
          loads_in_flight: bool = True) -> SchedulerState:
    weights = weights or Weights()
    return SchedulerState(backlog=[(r.request_id, r) for r in backlog], running={r.request_id: r for r in running},
                          workflows=len(running), weights=weights, engine_version=weights.served,
                          engine_busy=busy or bool(running), loads_in_flight=loads_in_flight,
                          cancelled_step=cancelled_step, now=now, now_ms=NOW_MS, wait=wait)


def plan_of(policy: RolloutPolicy | None = None, limits: WorkLimits | None = None, **kwargs):
    backlog = kwargs.pop("backlog", ())
    return RolloutScheduler(policy or RolloutPolicy(), limits).plan(state(*backlog, **kwargs))


def test_cancelled_late_and_over_limit_requests_are_finished_at_once_in_the_order_read():  # 1. and 2.
    backlog = (request("cancelled", step=3), request("eval", step=3, kind=RolloutKind.EVAL),
               request("late", step=5, deadline_ms=NOW_MS), request("greedy", step=5, repeat=5),
               request("fine", step=5))
    plan = plan_of(limits=WorkLimits(max_repeat_times=4), backlog=backlog, cancelled_step=3)
    assert [(v.key, v.status, v.reason) for v in plan.finish] == [
        ("cancelled", RolloutStatus.CANCELLED, None), ("late", RolloutStatus.TIMEOUT, None),
        ("greedy", RolloutStatus.FAILED, "over-limit")]
    assert "limits.max_repeat_times" in plan.finish[2].error and "deadline" in plan.finish[1].error
    assert plan.admit == ["eval", "fine"]  # eval rounds are never cancelled
    assert not plan.swap and plan.wait is None


def test_continuous_batching_admits_up_to_the_room_left():  # 3.
    plan = plan_of(RolloutPolicy(requests_in_flight=3), backlog=[request(f"r{i}") for i in range(4)],
                   running=(request("busy"),))
    assert plan.admit == ["r0", "r1"]


def test_batch_mode_admits_a_whole_batch_only_onto_an_idle_engine():  # 3.
    backlog = [request(f"r{i}") for i in range(12)]
    assert plan_of(RolloutPolicy(batching="batch"), backlog=backlog, running=(request("busy"),)).admit == []
    assert plan_of(RolloutPolicy(batching="batch"), backlog=backlog).admit == [f"r{i}" for i in range(12)]


def test_drain_a_request_for_new_weights_stops_admission_until_nothing_runs_then_swaps():  # 4.
    backlog = (request("needs-v1", min_version=1), request("after"))
    weights = Weights(published=1)
    running = plan_of(backlog=backlog, weights=weights, running=(request("busy"),))
    assert running.admit == [] and not running.swap and running.wait is None  # drain first; no wait meanwhile
    drained = plan_of(backlog=backlog, weights=weights)
    assert drained.swap and drained.admit == []  # the core swaps, then plans again
    assert plan_of(backlog=backlog, weights=Weights(served=1, published=1)).admit == ["needs-v1", "after"]


def test_requests_before_one_that_needs_new_weights_start_and_then_keep_the_engine_from_draining():  # 4.
    plan = plan_of(backlog=(request("now"), request("needs-v1", min_version=1)), weights=Weights(published=1))
    assert plan.admit == ["now"] and not plan.swap


def test_in_flight_swaps_under_running_requests_unless_the_engine_cannot_load_while_its_calls_run():  # 4.
    policy = RolloutPolicy(weight_update="in_flight")
    backlog, running, weights = (request("needs-v1", min_version=1),), (request("busy"),), Weights(published=1)
    assert plan_of(policy, backlog=backlog, weights=weights, running=running).swap
    assert not plan_of(policy, backlog=backlog, weights=weights, running=running, loads_in_flight=False).swap


def test_following_the_latest_swaps_before_admitting_anything():  # 4.
    plan = plan_of(RolloutPolicy(follows_latest=True), backlog=(request("a"),), weights=Weights(published=3))
    assert plan.swap and plan.admit == []
    busy = plan_of(RolloutPolicy(follows_latest=True), backlog=(request("a"),), weights=Weights(published=3),
                   running=(request("busy"),))
    assert not busy.swap and busy.admit == []  # drain first: "a" would start on weights about to be replaced


def test_waiting_for_a_version_not_published_is_a_state_and_fails_only_after_the_limit():  # 4.
    policy = RolloutPolicy(max_version_wait_s=60)
    backlog = (request("v5", min_version=5), request("v0"), request("v7", min_version=7))
    first = plan_of(policy, backlog=backlog, now=100.0)
    assert first.wait == VersionWait(5, 100.0) and first.admit == [] and first.finish == []
    waiting = plan_of(policy, backlog=backlog, now=159.0, wait=first.wait)
    assert waiting.wait == VersionWait(5, 100.0) and waiting.finish == []  # measured from when the wait began
    over = plan_of(policy, backlog=backlog, now=160.0, wait=first.wait, weights=Weights(served=2, published=2))
    assert [(v.key, v.status, v.reason) for v in over.finish] == [("v5", RolloutStatus.FAILED, "version-wait"),
                                                                   ("v7", RolloutStatus.FAILED, "version-wait")]
    assert over.finish[0].error == ("weights v5 were needed; after 60s (limits.max_version_wait_s) this worker "
                                    "serves v2 (the newest published is v2)")
    assert over.admit == ["v0"] and over.wait is None  # what the engine can serve goes on


def test_a_version_published_while_waiting_is_swapped_to():  # 4.
    backlog = (request("v1", min_version=1),)
    wait = plan_of(backlog=backlog).wait
    plan = plan_of(backlog=backlog, weights=Weights(published=1), wait=wait, now=101.0)
    assert plan.swap and plan.wait is None


def test_in_flight_no_wait_begins_while_requests_run():  # 4.
    plan = plan_of(RolloutPolicy(weight_update="in_flight"), backlog=(request("v1", min_version=1),),
                   running=(request("busy"),))
    assert plan.wait is None and not plan.swap and plan.admit == []


def test_a_refused_version_fails_what_needs_it_at_once():  # 4.
    plan = plan_of(backlog=(request("v1", min_version=1),), weights=Weights(published=1, refused_versions={1}))
    assert [(v.key, v.reason) for v in plan.finish] == [("v1", "version-wait")] and plan.wait is None
    assert "was refused" in plan.finish[0].error


def test_running_requests_past_their_deadline_are_stopped():  # 5.
    plan = plan_of(running=(request("late", deadline_ms=NOW_MS - 1), request("on-time", deadline_ms=NOW_MS + 1),
                            request("no-deadline")))
    assert plan.stop == ["late"]


def test_a_plan_is_a_function_of_its_state():
    scheduler = RolloutScheduler(RolloutPolicy(requests_in_flight=1))
    same = state(request("a"), request("b"), request("v3", min_version=3))
    assert scheduler.plan(same) == scheduler.plan(same)
