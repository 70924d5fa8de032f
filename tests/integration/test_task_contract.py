"""What the explorer does with a producer's task (the fake engine, the real broker): a payload its workflow's
schema refuses is dead-lettered naming the key; a task's ``taskset`` is kept as the producer wrote it, or, where
``explorer.tasksets`` gives the topic to another taskset, dead-lettered saying which name the topic takes."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import RolloutRequest, RolloutResult, Task

from .roles import RoleThread, read_all, wait_for

pytestmark = pytest.mark.kafka


def _task(i: int, taskset: str, **payload) -> Task:
    body = payload or {"question": f"What is {i} + 1?", "answer": i + 1}
    return Task(task_id=f"c{i}", workflow="arithmetic", taskset=taskset, payload=json.dumps(body))


def _run(config, topic: str, tasks: list[Task]) -> KafkaClients:
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    producer = clients.producer()
    for task in tasks:
        producer.produce(topic, task, partition=0)
    producer.flush()
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    try:
        wait_for(explorer, [worker], 90)
    finally:
        worker.stop.request()
        worker.join(60)
    return clients


def _letters(config, clients, topic: str) -> dict[str, tuple[str, str]]:
    """task key -> (reason, error) of each dead letter of ``topic``."""
    out = {}
    for raw in read_to_end(config.kafka, clients.bootstrap, topic + ".dlq"):
        headers = dict(raw.headers)
        out[raw.key.decode()] = (headers["streamrft.reason"].decode(), headers["streamrft.error"].decode())
    return out


def test_a_named_tasksets_topic_keeps_its_tasks_and_refuses_another_tasksets_and_a_bad_payload(run_config):
    config = run_config(
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 2, "repeat_times": 2, "metrics_port": None,
                  "tasksets": [{"name": "chat", "topic": "chat"}]},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    topic = config.topic_prefix + "tasks.chat"
    good = [_task(i, "chat") for i in range(4)]
    clients = _run(config, topic, [good[0], _task(7, "math"), good[1], _task(8, "chat", question="no answer"),
                                   *good[2:]])

    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    assert Counter(r.task.task_id for r in requests) == {t.task_id: 1 for t in good}
    assert {r.task.taskset for r in requests} == {"chat"}
    letters = _letters(config, clients, topic)
    assert set(letters) == {"c7", "c8"}
    reason, error = letters["c7"]
    assert reason == "taskset-mismatch"
    assert "names taskset 'math'" in error and "feeds taskset 'chat'" in error and "--taskset math" in error
    reason, error = letters["c8"]
    assert reason == "bad-payload" and "payload field 'answer' is missing" in error and "exact_number" in error
    clients.close()


def test_without_named_tasksets_a_producers_taskset_reaches_the_request_and_result_as_written(run_config):
    config = run_config(
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 2, "repeat_times": 2, "metrics_port": None},
        rollout={"engine": "fake", "fake_latency_s": 0.0, "metrics_port": None})
    tasks = [_task(0, "gsm8k"), _task(1, "gsm8k"), _task(2, "default"), _task(3, "outside")]
    clients = _run(config, config.topic("tasks"), tasks)

    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest)
    assert {r.task.task_id: r.task.taskset for r in requests} == {t.task_id: t.taskset for t in tasks}
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    assert {r.task_id: r.taskset for r in results} == {t.task_id: t.taskset for t in tasks}
    assert _letters(config, clients, config.topic("tasks")) == {}
    clients.close()
