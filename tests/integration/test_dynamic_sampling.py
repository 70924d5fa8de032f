"""DAPO's dynamic sampling on the real broker with the fake engine (fast): the explorer fills each step with more
tasks until it holds ``batch_size`` informative groups, the worker writes the experiences of those groups only, and
an explorer stopped in the middle of filling a step is taken over by a new one that finishes it, rolling out no
task twice."""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.engines.workflows.arithmetic import ArithmeticWorkflow
from streamrft.engines.workflows.registry import register_workflow
from streamrft.kafka import KafkaClients
from streamrft.rollout_stats import informative
from streamrft.schemas import Experience, Metric, RolloutRequest, RolloutResult

from .roles import RoleThread, produce_tasks, read_all, wait_for

pytestmark = pytest.mark.kafka

BATCH, MAX_STEPS = 4, 2


class Uniform:
    """Task ids whose samples all get reward 1 (the ``test_dapo_groups`` workflow below); every other task's
    samples alternate 0 and 1."""

    ids: set[str] = set()


@register_workflow("test_dapo_groups", replace=True)
class _GroupRewards(ArithmeticWorkflow):
    def run(self, task, payload, engine, repeat_times, sampling):
        samples = super().run(task, payload, engine, repeat_times, sampling)
        for index, sample in enumerate(samples):
            sample.reward = 1.0 if task.task_id in Uniform.ids else float(index % 2)
        return samples


def _tasks(count: int, seed: int):
    tasks = [dataclasses.replace(t, workflow="test_dapo_groups") for t in make_arithmetic_tasks(count, seed=seed)]
    Uniform.ids = {t.task_id for i, t in enumerate(tasks) if i % 3 == 0}  # a third carry no gradient
    return tasks


def _config(run_config, latency_s: float):
    return run_config(
        mode="explore",
        explorer={"batch_size": BATCH, "repeat_times": 2, "max_steps": MAX_STEPS, "metrics_port": None,
                  "dynamic_sampling": {"enabled": True, "max_rounds": 16}},
        rollout={"engine": "fake", "fake_latency_s": latency_s, "requests_in_flight": 2, "metrics_port": None})


def _check_the_run(config, clients) -> dict[int, dict[str, float]]:
    """Every step holds BATCH informative groups, no task went out twice, and what the worker wrote is exactly
    the informative groups' experiences; the explorer's metrics of each step, reported once."""
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest, idle=1.0)
    assert max(Counter(r.task.task_id for r in requests).values()) == 1
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1.0)
    assert len(results) == len(requests)  # one result per request: none redone
    kept = {r.request_id for r in results if informative(r)}
    assert Counter(r.step for r in results if informative(r)) == {step: BATCH for step in range(MAX_STEPS)}
    filtered = [r for r in results if not informative(r)]
    assert filtered and all(r.task_id in Uniform.ids for r in filtered)
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1.0)
    assert Counter(e.group_id for e in experiences) == dict.fromkeys(kept, 2)
    by_step: dict[int, dict[str, float]] = {}
    for metric in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=1.0):
        if metric.role == "explorer":
            assert metric.name not in by_step.setdefault(metric.step, {}), f"{metric.name} of step {metric.step} twice"
            by_step[metric.step][metric.name] = metric.value
    for step in range(MAX_STEPS):
        values = by_step[step]
        assert values["rollout/informative_groups"] == BATCH
        assert values["rollout/filtered_groups"] == sum(r.step == step for r in filtered)
        assert values["rollout/tasks"] == BATCH + values["rollout/filtered_groups"]
    return by_step


def test_each_step_is_filled_with_informative_groups_and_only_they_are_written(run_config):
    config = _config(run_config, latency_s=0.0)
    tasks = _tasks(24, seed=21)
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, tasks)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(explorer, [worker], 90)
    worker.stop.request()
    worker.join(60)

    by_step = _check_the_run(config, clients)
    assert explorer.result.done and explorer.result.next_step == MAX_STEPS
    assert sum(by_step[step]["rollout/oversample_rounds"] for step in range(MAX_STEPS)) >= 1
    clients.close()


def test_an_explorer_stopped_while_filling_a_step_is_taken_over_and_the_step_finishes_once(run_config):
    config = _config(run_config, latency_s=0.15)
    tasks = _tasks(24, seed=22)
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, tasks)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    first = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    deadline = time.monotonic() + 60
    while not (first.role and any(r.oversampled and r.missing for r in first.role.window)):
        assert time.monotonic() < deadline and first.thread.is_alive(), "no step was ever filled"
        time.sleep(0.02)
    first.stop.request()
    first.join(60)
    left = [entry for entry in first.result.in_flight if entry.get("oversampled")]
    assert left and not first.result.done  # the state record says a step was being filled
    second = RoleThread("explorer-2", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(second, [worker], 90)
    worker.stop.request()
    worker.join(60)

    by_step = _check_the_run(config, clients)
    assert second.result.done and second.result.next_step == MAX_STEPS
    step = left[0]["step"]
    assert by_step[step]["rollout/oversample_rounds"] >= left[0]["oversampled"]  # counted on from the record
    clients.close()
