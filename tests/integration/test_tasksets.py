"""Several training tasksets through the loop on the broker (task scheduling): a file-fed and a
topic-fed taskset mixed 3:1, trained, with the explorer stopped and restarted mid-run; and the difficulty order
with skip_solved, which stops spending rollouts on the tasks the policy already solves."""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference.fake import FakeEngine
from streamrft.kafka import KafkaClients
from streamrft.producers.task_files import FieldMapping, read_tasks
from streamrft.schemas import Experience, Metric, RolloutKind, RolloutRequest, Task

from .roles import RoleThread, read_all, wait_for
from .test_trainer_side import _settings, audit_eids, trainer_thread

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def write_tasks(path, prefix: str, count: int) -> str:
    path.write_text("".join(json.dumps({"question": f"What is {prefix} {i}?", "answer": i}) + "\n"
                            for i in range(count)))
    return str(path)


def produce_to(clients, topic: str, tasks: list[Task]) -> None:
    producer = clients.producer()
    for task in tasks:
        producer.produce(topic, task)
    producer.flush()


def test_two_tasksets_mixed_three_to_one_are_trained_by_weight_and_resume_exactly(run_config, tiny_model_dir,
                                                                                 tmp_path):
    steps, batch = 10, 8
    math_file = write_tasks(tmp_path / "math.jsonl", "m", 100)
    settings = _settings(tiny_model_dir, tmp_path / "ckpt",
                         explorer={"batch_size": batch, "repeat_times": 2, "max_steps": steps, "total_epochs": 5,
                                   "max_inflight_steps": 2, "selector": {"seed": 11},
                                   "tasksets": [{"name": "math", "path": math_file, "weight": 3.0},
                                                {"name": "chat", "topic": "chat", "weight": 1.0}]},
                         sync={"style": "fully_async", "max_staleness": 2},
                         trainer={"total_steps": steps, "save_interval": 100, "micro_batch_size": 16})
    settings["rollout"].update(engine="fake", fake_latency_s=0.02)
    config = run_config(**settings)
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    chat = [Task(task_id=f"chat-{i}", workflow="arithmetic", taskset="chat",
                 payload=json.dumps({"question": f"What is {i} + 1?", "answer": i + 1})) for i in range(60)]
    produce_to(clients, config.topic_prefix + "tasks.chat", chat)

    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    trainer = trainer_thread(config, clients)
    first = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    deadline = time.monotonic() + 120
    while first.role is None or first.role.state.next_step < 4:
        assert time.monotonic() < deadline and first.thread.is_alive(), "the explorer did not get to step 4"
        time.sleep(0.05)
    first.stop.request()  # mid-run, with a step in flight and both tasksets part-way
    first.join(60)
    assert 4 <= first.result.next_step < steps
    second = RoleThread("explorer-2", lambda stop: Explorer(config, clients, stop)).start()
    try:
        wait_for(trainer, [worker, second], 240)
        wait_for(second, [worker], 60)
    finally:
        worker.stop.request()
        worker.join(60)

    requests = [r for r in read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
                if r.kind == RolloutKind.TRAIN]
    by_step: dict[int, list[RolloutRequest]] = {}
    for request in requests:
        by_step.setdefault(request.step, []).append(request)
    assert sorted(by_step) == list(range(steps)) and all(len(r) == batch for r in by_step.values())
    # each taskset handed out its tasks in its own order, none twice, none skipped, across the restart
    math_order = [t.task_id for t in read_tasks(math_file, FieldMapping(taskset="math")) if isinstance(t, Task)]
    for name, source in (("math", math_order), ("chat", [t.task_id for t in chat])):
        published = [r.task.task_id for s in range(steps) for r in sorted(by_step[s], key=lambda r: r.request_id)
                     if r.task.taskset == name]
        assert sorted(published, key=source.index) == source[:len(published)], name
    # ... and each step's mix is the seeded draw (the restart drew what the first explorer would have)
    for step in range(steps):
        drawn = Counter(random.Random(f"11:{step}").choices(["math", "chat"], weights=[3.0, 1.0], k=batch))
        assert Counter(r.task.taskset for r in by_step[step]) == drawn, step
    # the trained experiences follow the weights: math's share within 4 standard deviations of 3/4
    experiences = {e.eid: e for e in read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)}
    trained = [experiences[eid] for eid in audit_eids(tmp_path / "ckpt")]
    taskset_of = {r.request_id: r.task.taskset for r in requests}
    shares = Counter(taskset_of[e.group_id] for e in trained)
    n = sum(shares.values()) // 2  # tasks (2 samples each)
    assert n == steps * batch
    assert abs(shares["math"] / 2 / n - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n), shares
    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric) if m.role == "explorer"]
    per_step = {(m.step, m.name): m.value for m in metrics}
    assert sum(per_step[(s, "rollout/taskset/math/tasks")] for s in range(steps)) == shares["math"] / 2
    clients.close()


def test_difficulty_with_skip_solved_spends_fewer_rollouts_on_solved_tasks_step_by_step(run_config, tmp_path):
    """A scripted engine that can answer half the tasks (the other half it never gets right, as a tiny model
    would not), in explore mode: the first epoch rolls out every task, the later ones only the failed."""
    tasks = write_tasks(tmp_path / "mixed.jsonl", "x", 16)
    config = run_config(mode="explore",
                        explorer={"batch_size": 4, "repeat_times": 2, "total_epochs": 3,
                                  "metrics_port": None,
                                  "tasksets": [{"name": "mixed", "path": tasks,
                                                "order": {"kind": "difficulty", "skip_solved": True}}]},
                        rollout={"metrics_port": None, "requests_in_flight": 4})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()

    def answer(prompt: str, _sample: int) -> str:  # right for even numbers, wrong for odd ones
        number = int(prompt.rsplit("x ", 1)[1].split("?")[0])
        return str(number) if number % 2 == 0 else str(number + 1)

    engine = FakeEngine(responder=answer)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0", engine=engine)).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(explorer, [worker], 120)
    worker.stop.request()
    worker.join(60)

    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric) if m.role == "explorer"]
    accuracy = {m.step: m.value for m in metrics if m.name == "rollout/taskset/mixed/accuracy"}
    steps = sorted(accuracy)
    assert len(steps) == 4 + 2 + 2  # epoch 0: 16 tasks; epochs 1 and 2: only the 8 failed ones
    first, later = [accuracy[s] for s in steps[:4]], [accuracy[s] for s in steps[4:]]
    assert sum(first) / 4 == pytest.approx(0.5)  # half the rollouts of the first epoch go to solved tasks
    assert later == [0.0] * 4  # then none: the solved ones are skipped
    skipped = max(m.value for m in metrics if m.name == "explorer/taskset/mixed/skipped_solved")
    assert skipped == 16  # 8 solved tasks passed over in each of the two later epochs
    clients.close()
