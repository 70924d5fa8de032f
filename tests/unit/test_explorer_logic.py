"""The explorer's arithmetic, without Kafka: task selection, step metrics (pacing: test_pacing.py)."""
from __future__ import annotations

import math

import pytest

from streamrft.rollout_stats import eval_metrics, step_metrics
from streamrft.schemas import RolloutResult, RolloutStatus, Task
from streamrft.selection import Selector


def _tasks(n):
    return [Task(task_id=f"t{i}", workflow="w", payload="{}") for i in range(n)]


def test_sequential_keeps_topic_order_and_shuffle_is_a_seeded_permutation():
    tasks = _tasks(16)
    assert Selector("sequential").order(tasks, 0, 0) == tasks
    first = Selector("shuffle", seed=3).order(tasks, epoch=0, block=1)
    assert sorted(t.task_id for t in first) == sorted(t.task_id for t in tasks) and first != tasks
    assert Selector("shuffle", seed=3).order(tasks, 0, 1) == first  # a restart reproduces the block's order
    assert Selector("shuffle", seed=3).order(tasks, 1, 1) != first  # a new epoch reshuffles


def test_learnable_prefers_tasks_nearest_a_half_pass_rate():
    selector = Selector("learnable")
    for task_id, accuracy in (("t0", 1.0), ("t1", 0.0), ("t2", 0.6)):
        selector.observe(RolloutResult(request_id=task_id, step=0, task_id=task_id, status=RolloutStatus.OK,
                                       n=4, model_version=0, duration_ms=1, accuracy=accuracy))
    order = [t.task_id for t in selector.order(_tasks(4), 0, 0)]
    assert order[:2] == ["t3", "t2"]  # unseen (0.5) first, then 0.6; solved and hopeless last
    assert set(order[2:]) == {"t0", "t1"}


def test_unknown_selector_is_refused():
    with pytest.raises(ValueError, match="sequential"):
        Selector("random")


def _result(rid, status=RolloutStatus.OK, n=4, mean=0.5, std=0.5, low=0.0, high=1.0, acc=0.5, version=0):
    return RolloutResult(request_id=rid, step=3, task_id=rid, status=status, n=n, model_version=version,
                         duration_ms=100, reward_mean=mean, reward_std=std, reward_min=low, reward_max=high,
                         accuracy=acc, response_length_mean=10.0)


def test_step_metrics_pool_samples_and_count_every_outcome():
    results = [_result("a", mean=1.0, std=0.0, low=1.0, high=1.0, acc=1.0, version=2),
               _result("b", mean=0.0, std=0.0, low=0.0, high=0.0, acc=0.0, version=3),
               _result("c", status=RolloutStatus.FAILED, n=0)]
    metrics = step_metrics(results, step=3, version=3, expected=4)
    assert metrics["rollout/reward_mean"] == 0.5
    assert math.isclose(metrics["rollout/reward_std"], 0.5)  # pooled over 8 samples: four 1s, four 0s
    assert metrics["rollout/accuracy"] == 0.5 and metrics["rollout/pass_rate"] == 0.5
    assert metrics["rollout/ok"] == 2 and metrics["rollout/failed"] == 1
    assert metrics["rollout/cancelled"] == 1  # expected 4, only 3 results
    assert metrics["rollout/staleness"] == 0 and metrics["rollout/staleness_mean"] == 0.5


def test_eval_metrics_mean_and_best_at_n():
    results = [_result("a", mean=0.25, high=1.0, acc=0.25), _result("b", mean=0.0, high=0.0, acc=0.0)]
    metrics = eval_metrics("arith", results, n=4)
    assert metrics == {"eval/arith/mean@4": 0.125, "eval/arith/best@4": 0.5, "eval/arith/accuracy@4": 0.125,
                       "eval/arith/tasks": 2.0}
