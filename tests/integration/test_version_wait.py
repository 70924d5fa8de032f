"""A rollout worker waiting for weights on the real broker: the wait is a state of its core, never a block in its
loop, so the worker keeps polling and committing, and keeps its place in the group however long the version
takes (engines/rollout/scheduler.py)."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference import create_engine
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import (RolloutKind, RolloutRequest, RolloutResult, RolloutStatus, SyncKind, SyncMethod,
                               SyncSignal, Task)

from .roles import RoleThread

pytestmark = pytest.mark.kafka

MAX_POLL_INTERVAL_MS = 6000


def _request(request_id: str, min_version: int = 0) -> RolloutRequest:
    task = Task(task_id=request_id, workflow="arithmetic", payload=json.dumps({"question": "1 + 1", "answer": "2"}))
    return RolloutRequest(request_id=request_id, step=0, kind=RolloutKind.TRAIN, task=task, repeat_times=1,
                          min_model_version=min_version)


def _results(clients, config) -> list[RolloutResult]:
    return [clients.serde.decode(raw.value, raw.topic, RolloutResult)
            for raw in read_to_end(config.kafka, clients.bootstrap, config.topic("results"))]


def _publish(clients, config, version: int) -> None:
    """As a trainer does: the weights first, then the signal."""
    import torch

    from streamrft.engines.weights.object_store import ObjectStore

    published = ObjectStore(config.weights_url).publish([("w", torch.full((4,), float(version)))], version=version)
    producer = clients.producer()
    producer.produce(config.topic("sync"), SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version,
                                                      trainer_step=version, method=SyncMethod.OBJECT_STORE,
                                                      uri=published.uri, sha256=published.sha256,
                                                      nbytes=published.nbytes))
    producer.flush()


def test_a_version_published_after_max_poll_interval_finds_the_worker_still_in_its_group(run_config, tmp_path: Path):
    config = run_config(rollout={"engine": "fake", "metrics_port": None, "requests_in_flight": 2},
                        topics={"rollouts": {"partitions": 1}}, limits={"max_version_wait_s": 120},
                        trainer={"weights": {"url": tmp_path.as_uri()}},
                        kafka={"consumer": {"max.poll.interval.ms": MAX_POLL_INTERVAL_MS, "session.timeout.ms": 6000,
                                            "heartbeat.interval.ms": 1000}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    producer = clients.producer()
    for request in [_request("now"), _request("needs-v1", min_version=1), _request("after")]:
        producer.produce(config.topic("rollouts"), request)
    producer.flush()

    revoked: list = []

    def watched(stop) -> RolloutWorker:
        worker = RolloutWorker(config, clients, stop, "w1", engine=create_engine("fake"))
        take_revoked = worker.consumer.take_revoked

        def noting() -> set:
            taken = take_revoked()
            revoked.extend(taken)
            return taken

        worker.consumer.take_revoked = noting
        return worker

    worker = RoleThread("w1", watched).start()
    deadline = time.monotonic() + 60
    while {r.request_id for r in _results(clients, config)} != {"now"}:
        assert time.monotonic() < deadline and worker.error is None, worker.error
        time.sleep(0.2)
    time.sleep(MAX_POLL_INTERVAL_MS / 1000 * 1.5)  # the version comes later than the group waits for a poll
    assert {r.request_id for r in _results(clients, config)} == {"now"}  # "after" was read after it: it waits too
    assert worker.role.core.version_wait is not None and worker.role.core.version_wait.version == 1

    _publish(clients, config, 1)
    deadline = time.monotonic() + 60
    while len(_results(clients, config)) < 3:
        assert time.monotonic() < deadline and worker.error is None, worker.error
        time.sleep(0.2)
    rejoins = worker.role.runtime.registry.get_sample_value("streamrft_group_rejoins_total")
    worker.stop.request()
    worker.join(30)

    assert revoked == [] and rejoins == 0  # the group never let the worker go
    results = {r.request_id: r for r in _results(clients, config)}
    assert Counter(r.request_id for r in _results(clients, config)) == Counter({"now": 1, "needs-v1": 1, "after": 1})
    assert all(r.status == RolloutStatus.OK for r in results.values())
    assert results["needs-v1"].model_version == 1 and results["now"].model_version == 0
    clients.close()
