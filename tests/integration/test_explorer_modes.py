"""Explorer behaviours on the real broker with the fake engine (fast): epochs over the tasks topic with a
shuffled order, eval rounds, and over-rollout cancelling stragglers."""
from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference import create_engine
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.engines.workflows.arithmetic import ArithmeticWorkflow
from streamrft.engines.workflows.registry import register_workflow
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
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 4, "repeat_times": 2, "total_epochs": 2, "metrics_port": None, "eval_interval": 2,
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
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 4, "repeat_times": 2, "max_steps": 2, "metrics_port": None,
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
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 4, "repeat_times": 2, "total_epochs": None, "max_steps": 2, "idle_wait_s": 1.0,
                  "metrics_port": None},
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


class FlakyOnce:
    """Registered below as the ``test_flaky_once`` workflow: arithmetic that fails the first time it sees a
    task (in this process: the worker runs in a thread here)."""

    seen: set[str] = set()


@register_workflow("test_flaky_once", replace=True)
class _FlakyArithmetic(ArithmeticWorkflow):
    def run(self, task, payload, engine, repeat_times, sampling):
        if task.task_id not in FlakyOnce.seen:
            FlakyOnce.seen.add(task.task_id)
            raise RuntimeError("a transient failure of the environment")
        return super().run(task, payload, engine, repeat_times, sampling)


def test_a_task_past_its_timeout_is_stopped_retried_and_holds_nothing_else(run_config):
    """rollout.task_timeout_s 1.5 s: a task of 60 samples × 0.1 s is stopped (TIMEOUT), published again, stopped
    again; a task that fails once succeeds on its retry; the step ends long before the slow task would have."""
    config = run_config(
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 4, "repeat_times": 2, "max_steps": 1, "max_retries": 1, "metrics_port": None},
        rollout={"engine": "fake", "task_timeout_s": 1.5, "requests_in_flight": 8, "metrics_port": None})
    FlakyOnce.seen.clear()
    fast = make_arithmetic_tasks(2, seed=8)
    slow = dataclasses.replace(make_arithmetic_tasks(1, seed=9)[0], repeat_times=60)
    flaky = dataclasses.replace(make_arithmetic_tasks(1, seed=10)[0], workflow="test_flaky_once")
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, [*fast, slow, flaky])
    engine = create_engine("fake", latency_s=0.1, incremental=True)  # stoppable between engine steps, as vLLM
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0", engine=engine)).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    started = time.monotonic()
    wait_for(explorer, [worker], 90)
    elapsed = time.monotonic() - started
    worker.stop.request()
    worker.join(60)

    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    by_task = {}  # (topic order is per partition, and attempts of a task land on different partitions)
    for result in sorted(results, key=lambda r: r.request_id):
        by_task.setdefault(result.task_id, []).append((result.request_id, result.status))
    slow_id, flaky_id = f"s0-e0-{slow.task_id}", f"s0-e0-{flaky.task_id}"
    assert by_task[slow.task_id] == [(slow_id, RolloutStatus.TIMEOUT),
                                     (f"{slow_id}-retry1", RolloutStatus.TIMEOUT)]
    assert by_task[flaky.task_id] == [(flaky_id, RolloutStatus.FAILED), (f"{flaky_id}-retry1", RolloutStatus.OK)]
    assert all(statuses == [(f"s0-e0-{t.task_id}", RolloutStatus.OK)] for t in fast
               for statuses in [by_task[t.task_id]])
    assert elapsed < 4 * 1.5 + 20, elapsed  # the slow task alone would take 6 s per attempt; nothing waited on it
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert Counter(e.group_id for e in experiences) == {f"s0-e0-{fast[0].task_id}": 2, f"s0-e0-{fast[1].task_id}": 2,
                                                        f"{flaky_id}-retry1": 2}  # no partial samples of the slow one
    metrics = {m.name: m.value for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
               if m.role == "explorer" and m.step == 0}
    assert (metrics["rollout/tasks"], metrics["rollout/ok"], metrics["rollout/timeout"]) == (4, 3, 1)
    assert (metrics["rollout/retries"], metrics["rollout/retried_failed"], metrics["rollout/retried_timeout"]) == \
        (2, 1, 1)
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    assert all(r.deadline_ms for r in requests)
    clients.close()


@pytest.mark.parametrize("style", ["fixed", "trainer_driven", "fully_async"])
def test_explore_mode_runs_without_a_trainer_in_every_sync_style(run_config, style):
    """No trainer: in explore mode the explorer never waits for weights or a trainer's lag, whatever the style
    (fixed pacing would wait for v1 forever, and the unread experiences would stop it after
    max_buffered_batches)."""
    config = run_config(
        sync={"style": style, "max_staleness": 0, "max_buffered_batches": 1},
        mode="explore", explorer={"batch_size": 2, "repeat_times": 2, "max_steps": 4, "metrics_port": None},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    clients, state = _run(config, make_arithmetic_tasks(8, seed=11), timeout=60)
    assert state.done and state.next_step == 4
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    assert len(requests) == 8 and {r.min_model_version for r in requests} == {0}
    clients.close()


def _eval_file(tmp_path, count: int):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": i + 2}) + "\n"
                            for i in range(count)))
    return str(path)


def test_eval_rounds_run_beside_training_and_eval_on_start_evaluates_the_base_model(run_config, tmp_path):
    """Eval rounds do not block the explorer: the step after an eval round is published while the round is
    still in flight. eval_on_start adds a round for the base model (metrics at step -1)."""
    from streamrft.schemas import SyncKind, SyncSignal
    from streamrft.explorer_state import ExplorerState

    config = run_config(
        mode="explore",
        explorer={"batch_size": 2, "repeat_times": 2, "max_steps": 4, "eval_interval": 2,
                  "eval_on_start": True, "metrics_port": None,
                  "eval_tasksets": [{"name": "mini", "path": _eval_file(tmp_path, 4), "repeat_times": 4}]},
        rollout={"engine": "fake", "fake_latency_s": 0.05, "metrics_port": None})
    clients, state = _run(config, make_arithmetic_tasks(8, seed=12), timeout=90)
    assert state.done and state.in_flight == []

    signals = read_all(config, clients.bootstrap, "control", clients.serde, SyncSignal, idle=1)
    states = [ExplorerState.from_json(s.state) for s in signals if s.kind == SyncKind.EXPLORER_STATE]
    beside = [s for s in states if any(e.get("eval") == "mini" and e["step"] >= 0 for e in s.in_flight)
              and any(step > e["step"] for e in s.in_flight if "eval" in e for step in s.steps_in_flight)]
    assert beside, "no training step was published while an eval round was in flight"
    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
               if m.role == "explorer" and m.name == "eval/mini/mean@4"]
    assert sorted(m.step for m in metrics) == [-1, 1, 3]  # the base model, then after steps 1 and 3
    evals = [r for r in read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
             if r.kind == RolloutKind.EVAL]
    assert len(evals) == 3 * 4 and sum(r.request_id.startswith("eval-mini-base-") for r in evals) == 4
    clients.close()


def test_a_restarted_explorer_collects_the_steps_it_left_in_flight(run_config):
    """max_inflight_steps 3: the explorer stops with several steps in flight; a new one collects their results
    from where they begin on ``results`` and finishes every step once, rolling out no task twice."""
    config = run_config(
        mode="explore",
        explorer={"batch_size": 2, "repeat_times": 2, "max_steps": 6,
                  "max_inflight_steps": 3, "metrics_port": None},
        rollout={"engine": "fake", "fake_latency_s": 0.15, "requests_in_flight": 1, "metrics_port": None})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    tasks = make_arithmetic_tasks(12, seed=13)
    produce_tasks(clients, config, tasks)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    first = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    deadline = time.monotonic() + 60
    while first.role is None or len(first.role.window) < 2 or first.role.state.finished_step < 0:
        assert time.monotonic() < deadline and first.thread.is_alive(), "never two steps in flight"
        time.sleep(0.05)
    first.stop.request()
    first.join(60)
    left = first.result.steps_in_flight
    assert len(left) >= 2 and not first.result.done
    second = RoleThread("explorer-2", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(second, [worker], 90)
    worker.stop.request()
    worker.join(60)

    assert second.result.done and second.result.next_step == 6
    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
               if m.role == "explorer"]
    assert sorted(m.step for m in metrics if m.name == "time/step_s") == list(range(6))  # each finished once
    assert all(m.value == 2 for m in metrics if m.name == "rollout/ok")  # the left steps' results were found
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    assert Counter(r.task.task_id for r in requests) == {t.task_id: 1 for t in tasks}
    clients.close()


def test_a_duplicate_task_id_is_dead_lettered_once_with_where_the_first_is(run_config):
    """Two records of one block with the same task_id: the first is rolled out, the second goes to the DLQ once,
    naming the first's partition and offset; every other task is rolled out once."""
    from streamrft.kafka.reader import read_to_end
    from streamrft.schemas import Task

    config = run_config(
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 4, "repeat_times": 2, "metrics_port": None},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    tasks = make_arithmetic_tasks(6, seed=8)
    twin = tasks[1].task_id
    tasks[4] = dataclasses.replace(tasks[4], task_id=twin)  # same key: same partition, a later offset
    clients, state = _run(config, tasks)

    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    assert Counter(r.task.task_id for r in requests) == {t.task_id: 1 for t in tasks}
    assert [r.task.payload for r in requests if r.task.task_id == twin] == [tasks[1].payload]  # the first
    topic = config.topic("tasks")
    twins = sorted((raw.partition, raw.offset) for raw in read_to_end(config.kafka, clients.bootstrap, topic)
                   if clients.serde.decode(raw.value, topic, Task).task_id == twin)
    letters = [dict(raw.headers) for raw in read_to_end(config.kafka, clients.bootstrap, topic + ".dlq")]
    assert len(twins) == 2 and len(letters) == 1
    (partition, first), (_, second) = twins
    assert letters[0]["streamrft.reason"] == b"duplicate-task-id"
    assert (int(letters[0]["streamrft.source.partition"]), int(letters[0]["streamrft.source.offset"])) == (
        partition, second)
    assert (f"duplicate task_id {twin!r} (first at partition {partition} offset {first})"
            in letters[0]["streamrft.error"].decode())
    assert state.done
    clients.close()


def test_a_trainer_that_falls_behind_holds_the_explorer_back_in_a_live_run(run_config):
    """sync.max_buffered_batches in a live run: with no one training, the explorer publishes until the untrained
    experiences are over one step's worth and then waits, saying why; once they are consumed (the trainer's group
    commits past them) it goes on to the end."""
    from streamrft.schemas import Experience

    config = run_config(
        sync={"style": "fully_async", "max_staleness": 100, "max_buffered_batches": 1},
        explorer={"batch_size": 2, "repeat_times": 2, "max_steps": 4, "metrics_port": None},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, make_arithmetic_tasks(8, seed=13))
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    try:
        deadline = time.monotonic() + 60
        while not (explorer.role and "untrained" in explorer.role.state.waiting):
            assert time.monotonic() < deadline, "the explorer never waited for the trainer"
            assert explorer.error is None and worker.error is None
            time.sleep(0.2)
        held_at = explorer.role.state.next_step
        time.sleep(3)  # held, not slow: nothing more is published meanwhile
        held = explorer.role.state
        assert held.next_step == held_at < 4 and "max_buffered_batches 1" in held.waiting

        trainer_group = config.consumer_group("trainer")
        reader = clients.consumer([config.topic("experiences")], Experience, trainer_group, dead_letters=False)
        consumed = 0
        while explorer.thread.is_alive() and time.monotonic() < deadline + 60:  # a trainer that keeps up
            consumed += len(reader.poll(timeout=0.5))
            reader.commit_offsets(reader.fetch_positions())  # as the trainer does: past the markers
        reader.close()
        wait_for(explorer, [worker], 30)
    finally:
        worker.stop.request()
        explorer.stop.request()
        worker.join(60)
    assert explorer.result.done and explorer.result.next_step == 4 and consumed == 4 * 2 * 2
    clients.close()
