"""Continuous batching in the rollout worker on the real broker: a request commits as soon as its own samples
are done, out of order, and whoever reads the partition next redoes exactly the unfinished ones."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference import create_engine
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import Experience, RolloutKind, RolloutRequest, RolloutResult, Task

from .roles import RoleThread

pytestmark = pytest.mark.kafka

SLOW_SAMPLES = 40  # x 0.25 s: the first request runs 10 s
FAST = 4


def _request(request_id: str, repeat_times: int) -> RolloutRequest:
    task = Task(task_id=request_id, workflow="arithmetic", payload=json.dumps({"question": "1 + 1", "answer": "2"}))
    return RolloutRequest(request_id=request_id, step=0, kind=RolloutKind.TRAIN, task=task, repeat_times=repeat_times)


def _read(clients, config, name: str, record_type):
    return [clients.serde.decode(raw.value, raw.topic, record_type)
            for raw in read_to_end(config.kafka, clients.bootstrap, config.topic(name))]


def test_requests_commit_as_each_is_done_and_the_next_reader_redoes_only_the_unfinished(run_config):
    config = run_config(rollout={"engine": "fake", "metrics_port": None, "requests_in_flight": 8},
                        topics={"rollouts": {"partitions": 1}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    producer = clients.producer()
    for request in [_request("slow", SLOW_SAMPLES), *(_request(f"fast{i}", 1) for i in range(FAST))]:
        producer.produce(config.topic("rollouts"), request)
    producer.flush()

    # an engine with room in its batch: each request takes 0.25 s per sample from when it is submitted
    first = RoleThread("w1", lambda stop: RolloutWorker(
        config, clients, stop, "w1", engine=create_engine("fake", latency_s=0.25, incremental=True))).start()
    deadline = time.monotonic() + 60
    while {r.request_id for r in _read(clients, config, "results", RolloutResult)} != {f"fast{i}" for i in range(FAST)}:
        assert time.monotonic() < deadline and first.error is None, first.error
        time.sleep(0.2)
    # the fast ones are committed while the slow one (read first, lowest offset) still runs
    assert first.role.core.running == 1
    first.stop.request()
    first.join(30)

    # what the group committed: the slow request's offset, and the done ones above it in the metadata
    probe = clients.consumer([config.topic("rollouts")], RolloutRequest, config.consumer_group("rollout"), subscribe=False,
                             dead_letters=False)
    try:
        assert probe.committed([(config.topic("rollouts"), 0)]) == {(config.topic("rollouts"), 0): (0, "done:1,2,3,4")}
    finally:
        probe.close()

    second = RoleThread("w2", lambda stop: RolloutWorker(
        config, clients, stop, "w2", engine=create_engine("fake", incremental=True))).start()
    deadline = time.monotonic() + 60
    while "slow" not in {r.request_id for r in _read(clients, config, "results", RolloutResult)}:
        assert time.monotonic() < deadline and second.error is None, second.error
        time.sleep(0.2)
    second.stop.request()
    second.join(30)

    results = Counter(r.request_id for r in _read(clients, config, "results", RolloutResult))
    assert results == Counter({"slow": 1, **{f"fast{i}": 1 for i in range(FAST)}})
    experiences = _read(clients, config, "experiences", Experience)
    assert len({e.eid for e in experiences}) == len(experiences) == SLOW_SAMPLES + FAST
    assert {e.worker_id for e in experiences if e.group_id == "slow"} == {"w2"}


def test_a_worker_its_group_let_go_joins_again_and_redoes_only_what_it_had_not_committed(run_config):
    """The group lets a worker go while it holds uncommitted work (here: its first unit waits longer than
    max.poll.interval.ms before its commit, as a worker stuck through a group coordinator's failover does, while
    another member is in the group); its commit is refused, and instead of stopping the worker joins again and reads again from the
    committed offsets: every request has exactly one result, and the worker is still running."""
    config = run_config(rollout={"engine": "fake", "metrics_port": None, "requests_in_flight": 2},
                        topics={"rollouts": {"partitions": 1}},
                        kafka={"consumer": {"max.poll.interval.ms": 6000, "session.timeout.ms": 6000,
                                            "heartbeat.interval.ms": 1000}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    producer = clients.producer()
    requests = [_request(f"r{i}", 1) for i in range(6)]
    for request in requests:
        producer.produce(config.topic("rollouts"), request)
    producer.flush()

    stalled = threading.Event()

    class StuckCommitting(RolloutWorker):
        def _stage(self, unit):
            super()._stage(unit)
            if unit.due and not stalled.is_set():  # its first unit: longer than max.poll.interval.ms, no poll
                stalled.set()
                time.sleep(9)

    worker = RoleThread("w1", lambda stop: StuckCommitting(config, clients, stop, "w1",
                                                           engine=create_engine("fake"))).start()
    assert stalled.wait(60), worker.error

    # Another member joins meanwhile, so the group moves on without the stalled worker (alone, its late commit
    # could land as the empty group's). It reads and never commits; it leaves once the worker has joined again.
    bystander_leaves = threading.Event()

    def bystander():
        member = clients.consumer([config.topic("rollouts")], RolloutRequest, config.consumer_group("rollout"),
                                  dead_letters=False)
        while not bystander_leaves.is_set():
            member.poll(max_records=10, timeout=0.2)
        member.close()

    standing_by = threading.Thread(target=bystander, daemon=True)
    standing_by.start()
    rejoins = lambda: worker.role.runtime.registry.get_sample_value("streamrft_group_rejoins_total")  # noqa: E731
    deadline = time.monotonic() + 60
    while rejoins() < 1:
        assert time.monotonic() < deadline and worker.error is None, worker.error
        time.sleep(0.2)
    bystander_leaves.set()
    standing_by.join(30)

    deadline = time.monotonic() + 90
    while len(_read(clients, config, "results", RolloutResult)) < len(requests):
        assert time.monotonic() < deadline and worker.error is None, worker.error
        time.sleep(0.5)
    assert worker.thread.is_alive() and worker.error is None  # it joined again instead of stopping
    assert rejoins() == 1
    worker.stop.request()
    worker.join(30)

    results = Counter(r.request_id for r in _read(clients, config, "results", RolloutResult))
    assert results == Counter({r.request_id: 1 for r in requests})
    experiences = _read(clients, config, "experiences", Experience)
    assert len({e.eid for e in experiences}) == len(experiences) == len(requests)
