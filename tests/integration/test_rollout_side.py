"""Explorer + rollout workers on the real broker with a tiny real model."""
from __future__ import annotations

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience, RolloutResult, RolloutStatus

from .roles import RoleThread, group_sizes, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def _config(run_config, tiny_model_dir, **explorer):
    return run_config(
        model={"path": str(tiny_model_dir)},
        explorer={"batch_size": 8, "repeat_times": 4, "total_steps": 3, "sync_style": "fully_async",
                  "max_staleness": 100, "metrics_port": None, **explorer},
        rollout={"sampling": {"max_tokens": 6}, "metrics_port": None},
        topics={"rollouts": {"partitions": 4}},
    )


def _produce_tasks(clients, config, tasks):
    producer = clients.producer()
    for task in tasks:
        producer.produce(config.topic("tasks"), task)
    producer.flush()


def test_explorer_and_two_workers_account_for_every_sample(run_config, tiny_model_dir):
    config = _config(run_config, tiny_model_dir)
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    _produce_tasks(clients, config, make_arithmetic_tasks(24, seed=1))

    workers = [RoleThread(f"worker-{i}", lambda stop, i=i: RolloutWorker(config, clients, stop, f"w{i}")).start()
               for i in range(2)]
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    explorer.join(240)
    for worker in workers:
        worker.stop.request()
    for worker in workers:
        worker.join(60)

    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    assert len(experiences) == 3 * 8 * 4
    assert len({e.eid for e in experiences}) == len(experiences)
    assert set(group_sizes(experiences).values()) == {4}
    assert all(e.group_size == 4 and e.response_length > 0 for e in experiences)
    assert len(results) == 24 and {r.status for r in results} == {RolloutStatus.OK}
    assert sorted({r.batch_id for r in results}) == [0, 1, 2]
    assert {e.worker_id for e in experiences} == {"w0", "w1"}  # both group members took work
    assert explorer.result.done and explorer.result.next_step == 3
    clients.close()
