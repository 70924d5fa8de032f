"""The rollout core's admission and swap policy, without a broker: the fake engine and a scripted weights
source stand in for vLLM and the trainer's signals (engines/rollout/core.py)."""
from __future__ import annotations

import json
import time

from streamrft.engines.inference import create_engine
from streamrft.engines.inference.base import SamplingParams
from streamrft.engines.rollout import RolloutCore, RolloutPolicy
from streamrft.engines.settings.limits import WorkLimits
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus, Task

PARAMS = SamplingParams(max_tokens=2)


class ScriptedWeights:
    """Published versions appear when a test says so; loading one records the number of requests running."""

    def __init__(self, engine, core_running=lambda: 0) -> None:
        self.engine = engine
        self.published_versions: list[int] = []
        self.loads: list[tuple[int, int]] = []  # (version, requests running when it loaded)
        self.running = core_running

    def publish(self, version: int) -> None:
        self.published_versions.append(version)

    @property
    def published(self) -> int:
        return max(self.published_versions, default=0)

    def serves(self, minimum: int) -> bool:
        return self.engine.version >= minimum

    def newer_due(self) -> bool:
        return self.published > self.engine.version

    def swap_to_latest(self) -> bool:
        if not self.newer_due():
            return False
        self.loads.append((self.published, self.running()))
        self.engine.load_weights({}, self.published)
        return True

    def refused(self, minimum: int) -> bool:
        return False


def request(rid: str, *, step: int = 0, repeat: int = 2, min_version: int = 0, deadline_ms: int | None = None,
            kind: RolloutKind = RolloutKind.TRAIN) -> RolloutRequest:
    task = Task(task_id=rid, workflow="arithmetic", payload=json.dumps({"question": "1 + 1", "answer": "2"}))
    return RolloutRequest(request_id=rid, step=step, kind=kind, task=task, repeat_times=repeat,
                          min_model_version=min_version, deadline_ms=deadline_ms)


def core_with(policy: RolloutPolicy, *, latency_s: float = 0.05, limits: WorkLimits | None = None,
              incremental: bool = True):
    engine = create_engine("fake", latency_s=latency_s, incremental=incremental)
    weights = ScriptedWeights(engine)
    core = RolloutCore(engine, weights, policy, limits)
    weights.running = lambda: core.running
    return core, weights, engine


def drain(core: RolloutCore, cancelled_step: int = -1, timeout_s: float = 20.0) -> list:
    done = []
    deadline = time.monotonic() + timeout_s
    while not core.idle:
        assert time.monotonic() < deadline, "the core never finished"
        done += core.step(cancelled_step)
    return done


def test_continuous_batching_admits_up_to_the_limit_and_hands_back_each_when_done():
    core, _, _ = core_with(RolloutPolicy(requests_in_flight=2))
    for i, repeat in enumerate([6, 1, 1]):
        core.add(i, request(f"r{i}", repeat=repeat), PARAMS)
    core.step(-1, timeout=0)
    assert core.running == 2 and core.waiting == 1  # the third waits for room
    done = drain(core)
    assert [d.key for d in done] == [1, 2, 0]  # the short ones first: each is handed back when its own is done
    assert all(d.status == RolloutStatus.OK and len(d.samples) == d.request.repeat_times for d in done)


def test_batch_mode_admits_a_whole_batch_onto_an_idle_engine_only():
    core, _, _ = core_with(RolloutPolicy(batching="batch"))
    core.add("a", request("a", repeat=4), PARAMS)
    core.add("b", request("b", repeat=1), PARAMS)
    core.step(-1, timeout=0)
    assert core.running == 2
    core.add("c", request("c"), PARAMS)  # a request read while a batch runs waits for the whole batch
    while core.running:
        core.step(-1)
        assert core.running == 0 or core.waiting == 1
    assert [d.key for d in drain(core)] == ["c"]


def test_cancelled_late_and_over_limit_requests_are_done_at_once_with_the_reason():
    core, _, _ = core_with(RolloutPolicy(), limits=WorkLimits(max_repeat_times=4))
    core.add("cancelled", request("cancelled", step=3), PARAMS)
    core.add("eval", request("eval", step=3, kind=RolloutKind.EVAL), PARAMS)  # eval rounds are never cancelled
    core.add("late", request("late", step=5, deadline_ms=int(time.time() * 1000) - 1), PARAMS)
    core.add("greedy", request("greedy", step=5, repeat=5), PARAMS)
    done = {d.key: d for d in drain(core, cancelled_step=3)}
    assert done["cancelled"].status == RolloutStatus.CANCELLED and not done["cancelled"].samples
    assert done["eval"].status == RolloutStatus.OK
    assert done["late"].status == RolloutStatus.TIMEOUT
    assert done["greedy"].status == RolloutStatus.FAILED and done["greedy"].reason == "over-limit"
    assert "limits.max_repeat_times" in done["greedy"].error


def test_a_request_past_its_deadline_while_running_is_stopped():
    core, _, _ = core_with(RolloutPolicy(), latency_s=0.2)
    core.add("slow", request("slow", repeat=50, deadline_ms=int(time.time() * 1000) + 300), PARAMS)
    core.add("quick", request("quick", repeat=1), PARAMS)
    done = {d.key: d for d in drain(core)}
    assert done["slow"].status == RolloutStatus.TIMEOUT and done["slow"].duration_s < 5
    assert done["quick"].status == RolloutStatus.OK


def test_weights_change_only_on_a_drained_engine_and_no_sample_mixes_versions():
    core, weights, engine = core_with(RolloutPolicy(requests_in_flight=4), latency_s=0.1)
    core.add("v0-long", request("v0-long", repeat=8), PARAMS)
    core.step(-1, timeout=0)
    weights.publish(1)
    core.add("needs-v1", request("needs-v1", min_version=1), PARAMS)
    core.add("after", request("after"), PARAMS)  # read after it: admitted in order, so it waits too
    core.step(-1, timeout=0)
    assert core.running == 1 and core.waiting == 2 and engine.version == 0  # admission stopped: drain first
    done = {d.key: d for d in drain(core)}
    assert weights.loads == [(1, 0)]  # loaded with nothing running
    assert done["v0-long"].version == 0 and {s.model_version for s in done["v0-long"].samples} == {0}
    assert done["needs-v1"].version == 1 and {s.model_version for s in done["needs-v1"].samples} == {1}


def test_following_the_latest_swaps_as_soon_as_the_engine_is_drained():
    core, weights, engine = core_with(RolloutPolicy(follows_latest=True), latency_s=0.05)
    core.add("a", request("a", repeat=4), PARAMS)
    core.step(-1, timeout=0)
    weights.publish(3)  # nobody asks for v3, but the policy takes every new version
    core.add("b", request("b"), PARAMS)
    done = {d.key: d for d in drain(core)}
    assert weights.loads == [(3, 0)] and done["a"].version == 0 and done["b"].version == 3
    core.step(-1, timeout=0)
    assert weights.loads == [(3, 0)]  # nothing newer: no reload


def test_a_version_that_never_comes_fails_the_requests_that_need_it_with_the_reason():
    core, weights, _ = core_with(RolloutPolicy(max_version_wait_s=0.5))
    core.add("v5", request("v5", min_version=5), PARAMS)
    core.add("v0", request("v0"), PARAMS)
    done = {d.key: d for d in drain(core)}
    assert done["v5"].status == RolloutStatus.FAILED and done["v5"].reason == "version-wait"
    assert "weights v5 were needed" in done["v5"].error and "limits.max_version_wait_s" in done["v5"].error
    assert done["v0"].status == RolloutStatus.OK  # what the engine can serve goes on


def test_a_step_never_waits_for_a_version_and_a_version_published_later_is_admitted():
    clock = [0.0]
    engine = create_engine("fake", latency_s=0.0)
    weights = ScriptedWeights(engine)
    core = RolloutCore(engine, weights, RolloutPolicy(max_version_wait_s=600), clock=lambda: clock[0])
    core.add("v1", request("v1", min_version=1), PARAMS)
    for _ in range(3):
        started = time.monotonic()
        assert core.step(-1, timeout=0) == []
        assert time.monotonic() - started < 0.5  # waiting is a state: the step is back at once
        assert core.version_wait is not None and core.version_wait.version == 1 and core.waiting == 1
        clock[0] += 100.0
    weights.publish(1)
    done = drain(core)
    assert [(d.key, d.status, d.version) for d in done] == [("v1", RolloutStatus.OK, 1)]
    assert core.version_wait is None


def test_a_version_wait_fails_after_the_limit_counted_on_the_cores_clock():
    clock = [1000.0]
    engine = create_engine("fake", latency_s=0.0)
    core = RolloutCore(engine, ScriptedWeights(engine), RolloutPolicy(max_version_wait_s=600), clock=lambda: clock[0])
    core.add("v5", request("v5", min_version=5), PARAMS)
    assert core.step(-1, timeout=0) == []
    clock[0] += 599.0
    assert core.step(-1, timeout=0) == []
    clock[0] += 1.0
    (done,) = core.step(-1, timeout=0)
    assert done.status == RolloutStatus.FAILED and done.reason == "version-wait" and "after 600s" in done.error


def test_a_stop_during_a_version_wait_drops_the_backlog_without_an_outcome():
    engine = create_engine("fake", latency_s=0.0)
    weights = ScriptedWeights(engine)
    core = RolloutCore(engine, weights, RolloutPolicy(), stopped=lambda: True)
    core.add("v5", request("v5", min_version=5), PARAMS)
    assert core.step(-1, timeout=0) == [] and core.idle  # nothing committed: redelivered to the next reader


def test_abort_forgets_waiting_and_running_requests():
    core, _, _ = core_with(RolloutPolicy(requests_in_flight=1), latency_s=0.1)
    core.add(("p0", 1), request("running", repeat=20), PARAMS)
    core.add(("p0", 2), request("waiting"), PARAMS)
    core.add(("p1", 3), request("other", repeat=1), PARAMS)
    core.step(-1, timeout=0)
    assert core.running == 1
    core.abort([key for key in core.keys() if key[0] == "p0"])
    assert [d.key for d in drain(core)] == [("p1", 3)]


# -- rollout.weight_update: in_flight ----------------------------------------------------------------------------
def simulated_core(policy: RolloutPolicy):
    """The core on the simulated engine: a batch decoding one token per step, samples of 4 to 24 tokens."""
    engine = create_engine("simulated", step_s=0.002, min_tokens=4, max_num_seqs=64)
    weights = ScriptedWeights(engine)
    core = RolloutCore(engine, weights, policy)
    weights.running = lambda: core.running
    return core, weights, engine


LONG = SamplingParams(max_tokens=24, temperature=1.0)


def run_until_published(core, weights, version: int, after_steps: int) -> list:
    done = []
    for _ in range(after_steps):
        done += core.step(-1)
    weights.publish(version)
    return done + drain(core)


def test_in_flight_new_weights_take_over_running_samples_at_the_next_step_and_admission_never_waits():
    from streamrft.engines.inference.simulated import logprob_of

    core, weights, _ = simulated_core(RolloutPolicy(follows_latest=True, weight_update="in_flight"))
    for i in range(4):
        core.add(f"r{i}", request(f"r{i}", repeat=4), LONG)
    done = []
    for _ in range(3):
        done += core.step(-1)
    weights.publish(1)
    core.add("late", request("late", repeat=2), LONG)  # comes while the batch runs
    done += core.step(-1)
    assert weights.loads == [(1, 4)] and core.swaps_in_flight == 1  # loaded with 4 requests running
    assert core.running == 5  # ... and the late request went straight in
    done += drain(core)
    samples = [s for d in done if d.request.request_id != "late" for s in d.samples]
    assert samples and all(s.model_version == 0 and s.last_model_version == 1 for s in samples)
    for s in samples:  # some tokens on v0 (those the steps before the swap decoded), the rest on v1
        (switch, version), = s.version_switches
        assert version == 1 and 1 <= switch < len(s.logprobs)
        assert s.logprobs == [logprob_of(0)] * switch + [logprob_of(1)] * (len(s.logprobs) - switch)
    late = next(d for d in done if d.request.request_id == "late")
    assert all(s.model_version == 1 and not s.version_switches for s in late.samples)


def test_drain_keeps_every_sample_on_one_version_and_admission_waits_for_the_swap():
    core, weights, _ = simulated_core(RolloutPolicy(follows_latest=True, weight_update="drain"))
    for i in range(4):
        core.add(f"r{i}", request(f"r{i}", repeat=4), LONG)
    done = run_until_published(core, weights, 1, after_steps=3)
    core.add("late", request("late", repeat=2), LONG)
    done += drain(core)
    assert weights.loads == [(1, 0)] and core.swaps_in_flight == 0
    versions = {d.request.request_id: {(s.model_version, s.last_model_version) for s in d.samples} for d in done}
    assert versions == {**{f"r{i}": {(0, 0)} for i in range(4)}, "late": {(1, 1)}}


def test_in_flight_on_an_engine_that_cannot_load_under_running_calls_drains_first():
    core, weights, engine = core_with(RolloutPolicy(follows_latest=True, weight_update="in_flight"), latency_s=0.05)
    assert not engine.loads_in_flight and engine.incremental
    weights.running = lambda: engine.unfinished  # what the load is recorded with: calls in the engine
    core.add("a", request("a", repeat=2), PARAMS)
    while not engine.unfinished:  # until its call is in the engine
        core.step(-1)
    weights.publish(1)
    done = drain(core)
    assert weights.loads == [(1, 0)]  # not while the call ran
    assert {(s.model_version, s.last_model_version) for s in done[0].samples} == {(0, 0)}


def test_in_flight_a_request_for_weights_not_published_yet_waits_while_the_running_ones_go_on():
    core, weights, engine = simulated_core(RolloutPolicy(weight_update="in_flight", max_version_wait_s=5))
    core.add("now", request("now", repeat=2), LONG)
    core.add("next", request("next", repeat=2, min_version=1), LONG)
    done = []
    while engine.steps < 2:  # "now" is being decoded
        done += core.step(-1)
    assert core.running == 1 and core.waiting == 1 and core.version_wait is None  # no wait while "now" runs
    weights.publish(1)
    done += core.step(-1)
    assert core.running == 2 and weights.loads == [(1, 1)]  # loaded in flight, "next" admitted at once
    done += drain(core)
    by_id = {d.request.request_id: d for d in done}
    assert {(s.model_version, s.last_model_version) for s in by_id["now"].samples} == {(0, 1)}
    assert {(s.model_version, s.last_model_version) for s in by_id["next"].samples} == {(1, 1)}
