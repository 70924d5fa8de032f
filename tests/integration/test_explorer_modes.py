"""Explorer behaviours on the real broker with the fake engine (fast): epochs over the tasks topic with a
shuffled order, eval rounds, and over-rollout cancelling stragglers."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience, Metric, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus

from .roles import RoleThread, produce_tasks, read_all, wait_for, wait_for_explorer_step

pytestmark = pytest.mark.kafka


def _run(config, tasks, timeout=120):
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, tasks)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(explorer, [worker], timeout)
    worker.stop.request()
    worker.join(60)
    return clients, explorer.result


def test_two_shuffled_epochs_and_eval_rounds(run_config, tmp_path):
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n"
                                 for i in range(3)))
    config = run_config(
        explorer={"batch_size": 4, "repeat_times": 2, "total_epochs": 2, "sync_style": "fully_async",
                  "max_staleness": 100, "metrics_port": None, "eval_interval": 2,
                  "eval_tasksets": [{"name": "mini", "path": str(eval_file), "repeat_times": 2}],
                  "selector": {"kind": "shuffle", "block_steps": 4, "seed": 7}},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    tasks = make_arithmetic_tasks(6, seed=5)
    clients, state = _run(config, tasks)

    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    train = [r for r in requests if r.kind == RolloutKind.TRAIN]
    assert Counter(r.task.task_id for r in train) == {t.task_id: 2 for t in tasks}  # each task once per epoch
    assert [r.task.task_id for r in train] != [t.task_id for t in tasks] * 2  # shuffled, not topic order
    assert state.done and state.epoch == 1 and state.next_step == 3  # 12 rollouts in steps of 4
    evals = [r for r in requests if r.kind == RolloutKind.EVAL]
    assert len(evals) == 3  # one eval round, after step 1 (eval_interval 2)
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert len(experiences) == 12 * 2 and all(e.kind == RolloutKind.TRAIN for e in experiences)
    metrics = read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
    names = {m.name for m in metrics if m.role == "explorer"}
    assert {"eval/mini/mean@2", "eval/mini/best@2", "rollout/reward_mean", "rollout/accuracy"} <= names
    clients.close()


def test_over_rollout_finishes_steps_early_and_reports_the_rest_cancelled(run_config):
    config = run_config(
        explorer={"batch_size": 4, "repeat_times": 2, "total_steps": 2, "sync_style": "fully_async",
                  "max_staleness": 100, "metrics_port": None,
                  "over_rollout": {"ratio": 0.5}},
        rollout={"engine": "fake", "fake_latency_s": 0.4, "requests_in_flight": 1, "metrics_port": None})
    clients, state = _run(config, make_arithmetic_tasks(8, seed=6))

    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
               if m.role == "explorer"]
    by_step = {}
    for m in metrics:
        by_step.setdefault(m.step, {})[m.name] = m.value
    assert state.done and sorted(by_step) == [0, 1]
    for values in by_step.values():
        assert values["rollout/ok"] >= 2  # ceil((1 − 0.5) · 4)
        assert values["rollout/ok"] + values["rollout/cancelled"] == 4  # the rest reported, not lost
    assert sum(v["rollout/cancelled"] for v in by_step.values()) >= 1
    # a worker that reaches a cancelled step's request answers CANCELLED instead of running it
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    assert RolloutStatus.CANCELLED in {r.status for r in results}
    clients.close()


def test_streaming_mode_rolls_out_tasks_injected_while_it_runs(run_config):
    import time

    config = run_config(
        explorer={"batch_size": 4, "repeat_times": 2, "total_epochs": None, "total_steps": 2, "idle_wait_s": 1.0,
                  "sync_style": "fully_async", "max_staleness": 100, "metrics_port": None},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    first, later = make_arithmetic_tasks(4, seed=8), make_arithmetic_tasks(4, seed=9)
    produce_tasks(clients, config, first)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for_explorer_step(explorer, 0, timeout=60)
    time.sleep(2)  # the topic is exhausted: a streaming explorer waits instead of finishing
    assert explorer.thread.is_alive() and explorer.role.state.next_step == 1
    produce_tasks(clients, config, later)
    wait_for(explorer, [worker], 60)
    worker.stop.request()
    worker.join(60)

    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    by_step = {}
    for request in requests:
        by_step.setdefault(request.step, set()).add(request.task.task_id)
    assert by_step == {0: {t.task_id for t in first}, 1: {t.task_id for t in later}}
    clients.close()
