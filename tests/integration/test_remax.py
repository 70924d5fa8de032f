"""ReMax through the real pieces on the broker: ``trainer.algorithm.advantage: remax`` alone makes the rollout
worker generate each task's greedy sample beside its group; the experiences it commits carry that sample's score
(and only the group's samples are experiences); the trainer's collate and advantage step turn them into
``reward − greedy reward``."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference.fake import FakeEngine
from streamrft.engines.settings.training import TrainingSettings
from streamrft.engines.training.advantage_step import fill_advantages
from streamrft.engines.training.batch import collate
from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience, RolloutResult, RolloutStatus, Task
from streamrft.schemas.experience_extras import GREEDY_REWARD

from .roles import RoleThread, produce_tasks, read_all, wait_for

pytestmark = [pytest.mark.kafka]


class GreedyKnowsTheSum(FakeEngine):
    """At temperature 0 the right sum; sampling, right on even sample indexes only. Counts both kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = Counter()

    def _sample(self, prompt_ids, index, params):
        self.drawn["greedy" if params.greedy else "sampled"] += 1
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)", self.decode(prompt_ids)).groups())
        self.responder = lambda prompt, j: str(a + b if params.greedy or j % 2 == 0 else a + b + 1)
        return super()._sample(prompt_ids, index, params)


def test_remax_workers_commit_the_greedy_baseline_with_each_group(run_config):
    config = run_config(
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 3, "repeat_times": 4, "max_steps": 2, "metrics_port": None},
        rollout={"engine": "fake", "metrics_port": None},
        trainer={"algorithm": {"advantage": "remax"}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    tasks = [Task(task_id=f"sum-{i}", workflow="arithmetic",
                  payload=json.dumps({"question": f"What is {i} + {2 * i + 1}?", "answer": 3 * i + 1}))
             for i in range(6)]
    produce_tasks(clients, config, tasks)
    engine = GreedyKnowsTheSum()
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0", engine=engine)).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    try:
        wait_for(explorer, [worker], 120)
    finally:
        worker.stop.request()
        worker.join(60)

    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    assert len(results) == 6 and {r.status for r in results} == {RolloutStatus.OK}
    assert engine.drawn == {"sampled": 24, "greedy": 6}  # one greedy sample per task, beside its 4
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert Counter(e.group_id for e in experiences) == {r.request_id: 4 for r in results}  # the greedy is none
    assert all(e.metrics[GREEDY_REWARD] == 1.0 for e in experiences)
    assert sorted(e.reward for e in experiences) == [0.0] * 12 + [1.0] * 12
    assert {r.reward_mean for r in results} == {0.5}  # the results count the group's samples only

    batch = collate(experiences)
    fill_advantages(batch, TrainingSettings(advantage="remax"))
    expected = (batch.rewards - 1.0)[:, None] * batch.response_mask
    assert torch.equal(batch.advantages, expected) and bool((batch.advantages < 0).any())
    clients.close()
