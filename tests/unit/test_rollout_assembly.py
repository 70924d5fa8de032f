"""What a finished request becomes, without a broker: its experiences and its result
(engines/rollout/assembly.py)."""
from __future__ import annotations

import json

from streamrft.engines.rollout import Done, assemble
from streamrft.engines.workflows.base import WorkflowSample
from streamrft.engines.workflows.rewards import RewardFailure
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus, Task


def request(kind: RolloutKind = RolloutKind.TRAIN) -> RolloutRequest:
    task = Task(task_id="t1", taskset="math", workflow="arithmetic", payload=json.dumps({"question": "1 + 1"}))
    return RolloutRequest(request_id="r1", step=4, kind=kind, task=task, repeat_times=3)


def sample(reward: float, *, correct: bool = False, failure: RewardFailure | None = None) -> WorkflowSample:
    return WorkflowSample(tokens=[1, 2, 3, 4], prompt_length=2, logprobs=[-0.1, -0.2], reward=reward,
                          correct=correct, failure=failure)


def done(samples, status: RolloutStatus = RolloutStatus.OK, kind: RolloutKind = RolloutKind.TRAIN, **details) -> Done:
    return Done("key", request(kind), status, version=7, samples=samples, duration_s=1.5, **details)


def test_a_training_request_becomes_one_experience_per_sample_and_a_result_with_its_statistics():
    assembled = assemble(done([sample(1.0, correct=True), sample(0.0), sample(0.5)]), "w1")
    assert [e.eid for e in assembled.experiences] == ["r1/0", "r1/1", "r1/2"]
    assert {(e.group_id, e.task_id, e.step, e.group_size, e.model_version, e.worker_id)
            for e in assembled.experiences} == {("r1", "t1", 4, 3, 7, "w1")}
    result = assembled.result
    assert (result.status, result.n, result.model_version, result.duration_ms) == (RolloutStatus.OK, 3, 7, 1500)
    assert (result.reward_mean, result.reward_min, result.reward_max) == (0.5, 0.0, 1.0)
    assert result.accuracy == 1 / 3 and result.response_length_mean == 2 and result.taskset == "math"
    assert assembled.failure is None and assembled.tokens == 6 and assembled.unscored == []


def test_an_eval_request_has_a_result_and_no_experiences():
    assembled = assemble(done([sample(1.0)], kind=RolloutKind.EVAL), "w1")
    assert assembled.experiences == [] and assembled.result.n == 1


def test_samples_the_reward_could_not_score_are_left_out_and_named():
    assembled = assemble(done([sample(1.0), sample(0.0, failure=RewardFailure("judge", "no score"))]), "w1")
    assert [e.eid for e in assembled.experiences] == ["r1/0"] and assembled.experiences[0].group_size == 1
    assert assembled.result.status == RolloutStatus.OK and assembled.result.n == 1
    error = assembled.result.error
    assert error.startswith("1 of 2 sample(s) not scored") and "sample 1: judge" in error
    assert assembled.unscored == ["judge"]


def test_no_sample_scored_fails_the_request_with_the_reason():
    failure = RewardFailure("judge", "no score")
    assembled = assemble(done([sample(0.0, failure=failure) for _ in range(7)]), "w1")
    assert assembled.experiences == [] and assembled.result.status == RolloutStatus.FAILED
    reason, error = assembled.failure
    assert reason == "reward-failed" and error.endswith("; and 2 more") and assembled.unscored == ["judge"] * 7


def test_failed_cancelled_and_timed_out_requests_have_a_result_and_nothing_else():
    failed = assemble(done([], RolloutStatus.FAILED, error="boom\n" + "x" * 9000, reason="workflow-error"), "w1")
    assert failed.failure[0] == "workflow-error" and failed.result.status == RolloutStatus.FAILED
    assert len(failed.result.error) == 8000  # the tail a result keeps
    for status in (RolloutStatus.CANCELLED, RolloutStatus.TIMEOUT):
        assembled = assemble(done([], status), "w1")
        assert assembled.failure is None and assembled.experiences == [] and assembled.result.status == status
