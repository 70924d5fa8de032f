"""Exactly-once hand-off: a consume -> produce process killed between produce and commit leaves nothing
visible to read_committed readers, and a restarted one does the work once."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from streamrft.kafka import KafkaClients
from streamrft.kafka.admin import ensure_topics
from streamrft.config import TopicConfig
from streamrft.kafka.reader import read_topic
from streamrft.schemas import Task

pytestmark = pytest.mark.kafka
WORKER = Path(__file__).with_name("eos_worker.py")
N = 40


def test_sigkill_between_produce_and_commit(run_config):
    config = run_config()
    bootstrap = config.kafka.bootstrap_servers
    clients = KafkaClients(config, bootstrap)
    in_topic, out_topic = config.topic_prefix + "eos-in", config.topic_prefix + "eos-out"
    ensure_topics(clients.admin(), {in_topic: TopicConfig(partitions=2), out_topic: TopicConfig(partitions=2),
                                    in_topic + ".dlq": TopicConfig()})
    producer = clients.producer()
    for i in range(N):
        producer.produce(in_topic, Task(task_id=f"task-{i}", workflow="w", payload="{}"))
    producer.flush()

    def worker(*extra):
        return subprocess.run([sys.executable, str(WORKER), bootstrap, config.name, in_topic, out_topic, str(N),
                               *extra], capture_output=True, text=True, timeout=120)

    crashed = worker("--crash-after-produce")
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    assert "CRASHING" in crashed.stdout

    uncommitted = list(read_topic(config.kafka, bootstrap, out_topic, read_committed=False, idle_timeout=2))
    assert uncommitted, "the killed worker's records should be on the broker (uncommitted)"
    assert list(read_topic(config.kafka, bootstrap, out_topic, idle_timeout=2)) == []

    finished = worker()
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"DONE {N}" in finished.stdout

    serde = clients.serde
    seen = Counter(serde.decode(r.value, out_topic).source
                   for r in read_topic(config.kafka, bootstrap, out_topic, idle_timeout=2))
    assert seen == Counter({f"task-{i}": 1 for i in range(N)})
    assert clients.lag(config.consumer_group("eos"), in_topic) == 0
    clients.close()
