"""State that outlives an explorer restart, on the broker: the difficulty order with skip_solved goes on knowing
which tasks the policy solves (rebuilt from ``results``), and several eval tasksets, each scored by its own
workflow, evaluate after the restart exactly as before it, each round once."""
from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference.fake import FakeEngine
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.kafka import KafkaClients
from streamrft.schemas import Metric, RolloutKind, RolloutRequest

from .roles import RoleThread, produce_tasks, read_all, wait_for

pytestmark = pytest.mark.kafka

SUM = re.compile(r"What is (\d+) \+ (\d+)\?")


def _restart_explorer_after(config, clients, worker, finished_step: int, timeout: float = 120):
    """An explorer run until ``finished_step`` is finished, stopped (a step may be in flight), and a second one
    started in its place; returns the second, finished."""
    first = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    deadline = time.monotonic() + timeout
    while first.role is None or first.role.state.finished_step < finished_step:
        assert time.monotonic() < deadline and first.thread.is_alive(), f"the explorer never finished step " \
                                                                        f"{finished_step}"
        time.sleep(0.05)
    first.stop.request()
    first.join(60)
    assert not first.result.done
    second = RoleThread("explorer-2", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(second, [worker], timeout)
    return second


def test_difficulty_with_skip_solved_remembers_the_solved_tasks_across_a_restart(run_config, tmp_path):
    """Half the tasks are always answered right: epoch 0 rolls out all 16, epochs 1 and 2 only the 8 others. The
    explorer is restarted in epoch 1, after its first step there: the new one must skip the same solved tasks."""
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is x {i}?", "answer": i}) + "\n" for i in range(16)))
    config = run_config(mode="explore",
                        explorer={"batch_size": 4, "repeat_times": 2, "total_epochs": 3, "metrics_port": None,
                                  "tasksets": [{"name": "mixed", "path": str(path),
                                                "order": {"kind": "difficulty", "skip_solved": True}}]},
                        rollout={"metrics_port": None, "requests_in_flight": 4})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()

    def answer(prompt: str, _sample: int) -> str:  # right for even numbers, wrong for odd ones
        number = int(prompt.rsplit("x ", 1)[1].split("?")[0])
        return str(number) if number % 2 == 0 else str(number + 1)

    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0",
                                                             engine=FakeEngine(responder=answer))).start()
    try:
        _restart_explorer_after(config, clients, worker, finished_step=4)  # step 4: the first of epoch 1
    finally:
        worker.stop.request()
        worker.join(60)

    requests = [r for r in read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
                if r.kind != RolloutKind.EVAL]
    per_task = Counter(int(json.loads(r.task.payload)["question"].rsplit("x ", 1)[1].rstrip("?")) for r in requests)
    assert sorted(r.step for r in requests) == sorted([s for s in range(8) for _ in range(4)])
    assert {n for n, times in per_task.items() if times == 1} == set(range(0, 16, 2))  # solved once, then skipped
    assert {n for n, times in per_task.items() if times == 3} == set(range(1, 16, 2))  # failed: every epoch
    clients.close()


def test_two_eval_tasksets_with_their_own_workflows_evaluate_after_a_restart_as_before(run_config, tmp_path):
    """The same questions in two eval tasksets, one scored by ``arithmetic`` (a bare number is right), one by
    ``math_boxed`` (only a \\boxed{} answer is): the engine answers bare numbers, so the first scores 1 and the
    second 0 at every eval round, before the explorer's restart and after it, each round published once."""
    questions = tmp_path / "eval.jsonl"
    questions.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": i + 2}) + "\n"
                                 for i in range(3)))
    config = run_config(
        mode="explore",
        explorer={"batch_size": 2, "repeat_times": 2, "max_steps": 6, "eval_interval": 2, "metrics_port": None,
                  "eval_tasksets": [{"name": "plain", "path": str(questions), "repeat_times": 2},
                                    {"name": "boxed", "path": str(questions), "repeat_times": 2,
                                     "workflow": "math_boxed"}]},
        rollout={"metrics_port": None, "requests_in_flight": 2})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    produce_tasks(clients, config, make_arithmetic_tasks(12, seed=3))

    def answer(prompt: str, _sample: int) -> str:
        found = SUM.search(prompt)
        return str(int(found.group(1)) + int(found.group(2))) if found else "0"

    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0",
                                                             engine=FakeEngine(responder=answer))).start()
    try:
        _restart_explorer_after(config, clients, worker, finished_step=2)  # after the first eval round began
    finally:
        worker.stop.request()
        worker.join(60)

    evals = [r for r in read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
             if r.kind == RolloutKind.EVAL]
    assert Counter(r.request_id for r in evals).most_common(1)[0][1] == 1  # no round published twice
    assert {(r.request_id.split("-")[1], r.task.workflow) for r in evals} == {("plain", "arithmetic"),
                                                                            ("boxed", "math_boxed")}
    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
               if m.role == "explorer" and m.name in ("eval/plain/mean@2", "eval/boxed/mean@2")]
    assert sorted((m.name, m.step) for m in metrics) == sorted(
        (name, step) for name in ("eval/plain/mean@2", "eval/boxed/mean@2") for step in (1, 3, 5))
    assert {m.value for m in metrics if m.name == "eval/plain/mean@2"} == {1.0}
    assert {m.value for m in metrics if m.name == "eval/boxed/mean@2"} == {0.0}
    clients.close()
