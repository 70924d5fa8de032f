"""DAPO's soft overlong punishment (engines/rollout/reward_shaping.py), without a broker: the formula of the
paper's Eq. 13 worked out by hand, what it does to a request's experiences and result, and its settings."""
from __future__ import annotations

import json

import pytest

from streamrft.config import load_config
from streamrft.engines.rollout import Done, OverlongShaping, assemble
from streamrft.engines.rollout.reward_shaping import PENALTY_METRIC, overlong_penalty
from streamrft.engines.settings.reward_shaping import OverlongPenalty
from streamrft.engines.workflows.base import WorkflowSample
from streamrft.errors import ConfigError
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutStatus, Task


@pytest.mark.parametrize(("length", "expected"), [
    (1, 0.0), (16, 0.0),  # |y| ≤ L_max − L_cache = 20 − 4: no penalty
    (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0),  # ((20 − 4) − |y|) / 4
    (21, -1.0), (500, -1.0),  # past L_max: −1
])
def test_the_penalty_is_eq_13_of_the_dapo_paper(length, expected):
    assert overlong_penalty(length, max_tokens=20, buffer_len=4) == pytest.approx(expected)
    assert overlong_penalty(length, max_tokens=20, buffer_len=4, penalty_factor=0.5) == pytest.approx(expected / 2)


def test_a_buffer_as_long_as_max_tokens_punishes_every_token():
    assert [overlong_penalty(n, 4, 4) for n in range(5)] == [0.0, -0.25, -0.5, -0.75, -1.0]


def sample(response: int, reward: float, action_mask: list[int] | None = None) -> WorkflowSample:
    return WorkflowSample(tokens=[1, 2] + [3] * response, prompt_length=2, logprobs=[-0.1] * response,
                          reward=reward, action_mask=action_mask, correct=reward > 0)


def test_shaping_adds_the_penalty_to_the_reward_and_records_it():
    shaping = OverlongShaping(OverlongPenalty(buffer_len=4, penalty_factor=1.0), max_tokens=8)
    samples = [sample(3, 1.0), sample(6, 1.0), sample(8, 0.0),
               sample(8, 1.0, action_mask=[1, 1, 0, 0, 0, 1, 1, 1])]  # 5 of its tokens are the policy's
    assert shaping.apply(samples) == [0.0, -0.5, -1.0, -0.25]
    assert [s.reward for s in samples] == [1.0, 0.5, -1.0, 0.75]
    assert [s.metrics[PENALTY_METRIC] for s in samples] == [0.0, -0.5, -1.0, -0.25]


def test_a_buffer_longer_than_max_tokens_is_refused():
    with pytest.raises(ValueError, match="buffer_len .9. must not exceed max_tokens .8."):
        OverlongShaping(OverlongPenalty(buffer_len=9), max_tokens=8)


def done(kind: RolloutKind, samples: list[WorkflowSample]) -> Done:
    task = Task(task_id="t1", taskset="math", workflow="arithmetic", payload=json.dumps({"question": "1 + 1"}))
    request = RolloutRequest(request_id="r1", step=0, kind=kind, task=task, repeat_times=len(samples))
    return Done("key", request, RolloutStatus.OK, version=0, samples=samples)


def test_a_training_request_is_written_with_shaped_rewards_and_an_eval_request_is_not_shaped():
    shaping = OverlongShaping(OverlongPenalty(buffer_len=4, penalty_factor=0.5), max_tokens=8)
    assembled = assemble(done(RolloutKind.TRAIN, [sample(2, 1.0), sample(8, 1.0)]), "w1", shaping)
    assert [e.reward for e in assembled.experiences] == [1.0, 0.5]
    assert [e.metrics[PENALTY_METRIC] for e in assembled.experiences] == [0.0, -0.5]
    result = assembled.result
    assert (result.reward_mean, result.reward_min, result.reward_max) == (0.75, 0.5, 1.0)
    assert assembled.penalties == [0.0, -0.5]
    assert result.accuracy == 1.0  # correctness is the task's, not the shaping's

    evaluated = assemble(done(RolloutKind.EVAL, [sample(8, 1.0)]), "w1", shaping)
    assert evaluated.result.reward_mean == 1.0 and evaluated.penalties == []


def test_without_shaping_nothing_changes():
    assembled = assemble(done(RolloutKind.TRAIN, [sample(8, 1.0)]), "w1")
    assert assembled.experiences[0].reward == 1.0 and assembled.penalties == []
    assert PENALTY_METRIC not in assembled.experiences[0].metrics


def test_the_setting_is_checked_against_max_tokens_when_the_config_loads():
    config = load_config(overrides={"rollout": {"sampling": {"max_tokens": 32},
                                                "overlong_penalty": {"buffer_len": 8}}}, env={})
    assert config.rollout.overlong_penalty == OverlongPenalty(buffer_len=8, penalty_factor=1.0)
    with pytest.raises(ConfigError, match=r"buffer_len \(40\) must not exceed rollout.sampling.max_tokens \(32\)"):
        load_config(overrides={"rollout": {"sampling": {"max_tokens": 32}, "overlong_penalty": {"buffer_len": 40}}},
                    env={})
    with pytest.raises(ConfigError, match="penalty_factor"):
        load_config(overrides={"rollout": {"overlong_penalty": {"buffer_len": 4, "penalty_factor": -1}}}, env={})


def test_the_worker_reports_the_mean_penalty_and_the_share_punished():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from streamrft.consumers.rollout.metrics import RolloutMetrics

    metrics = RolloutMetrics(CollectorRegistry(), SimpleNamespace(running=0, busy_s=0.0, swaps_in_flight=0))
    shaping = OverlongShaping(OverlongPenalty(buffer_len=4), max_tokens=8)
    metrics.assembled(assemble(done(RolloutKind.TRAIN, [sample(2, 1.0), sample(6, 1.0)]), "w1", shaping))
    metrics.assembled(assemble(done(RolloutKind.TRAIN, [sample(8, 0.0), sample(1, 0.0)]), "w1", shaping))
    values = metrics.of_commit(2, 4)
    assert values["rollout_worker/overlong_penalty_mean"] == pytest.approx((0 - 0.5 - 1.0 + 0) / 4)
    assert values["rollout_worker/overlong_punished_frac"] == 0.5
    assert "rollout_worker/overlong_penalty_mean" not in metrics.of_commit(0, 0)  # per commit: reset

