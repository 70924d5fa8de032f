"""Bad records go to the dead-letter topic with their reason and origin; the consumer keeps going; every
record is accounted for. Topic creation is idempotent."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from streamrft.kafka import KafkaClients
from streamrft.kafka.admin import run_topics
from streamrft.kafka.reader import read_topic
from streamrft.schemas import Metric, SingleObjectCodec, Task

pytestmark = pytest.mark.kafka


def _bad_payloads() -> dict[str, bytes]:
    good = SingleObjectCodec().encode(Task(task_id="x" * 30, workflow="arithmetic", payload='{"q": 1}'))
    return {
        "unknown-magic": b"garbage \xff\xfe bytes",
        "truncated": good[: len(good) // 2],
        "unknown-fingerprint": b"\xc3\x01" + bytes(range(8)) + good[10:],
        "registry-not-configured": b"\x00\x00\x00\x00\x07" + good[10:],
        "wrong-record-type": SingleObjectCodec().encode(Metric(source="s", role="r", name="n", value=1, step=0)),
        "header-only": b"\xc3\x01\x01",
    }


def test_undecodable_records_go_to_the_dlq_and_consumption_continues(run_config):
    config = run_config()
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    topic = config.topic("tasks")
    producer = clients.producer()
    bad = _bad_payloads()
    expected_reasons = Counter()
    good_ids = []
    for round_ in range(5):
        for reason, payload in bad.items():
            producer.produce_raw(topic, payload, f"bad-{round_}-{reason}".encode())
            expected_reasons["truncated" if reason == "header-only" else reason] += 1
        for i in range(20):
            task = Task(task_id=f"good-{round_}-{i}", workflow="arithmetic", payload="{}")
            producer.produce(topic, task)
            good_ids.append(task.task_id)
    producer.flush()

    consumer = clients.consumer([topic], Task, config.consumer_group("dlq-test"))
    decoded = []
    deadline = time.monotonic() + 60
    while len(decoded) + consumer.dead_lettered < len(good_ids) + sum(expected_reasons.values()):
        assert time.monotonic() < deadline, "consumer stalled"
        decoded += [d.record.task_id for d in consumer.poll(max_records=100, timeout=1.0)]
        consumer.commit()
    consumer.close()

    assert decoded == good_ids  # one partition: order kept, nothing lost around the bad records
    letters = list(read_topic(config.kafka, clients.bootstrap, topic + ".dlq", idle_timeout=2))
    headers = [dict(letter.headers) for letter in letters]
    assert Counter(h["streamrft.reason"].decode() for h in headers) == expected_reasons
    for letter, h in zip(letters, headers):
        assert h["streamrft.source.topic"].decode() == topic
        assert h["streamrft.stage"] == b"decode"
        assert h["streamrft.error"]
        # the original bytes and key are kept, so the record can be repaired and replayed
        assert letter.key.decode().startswith("bad-")
        reason = letter.key.decode().split("-", 2)[2]
        assert letter.value == bad[reason]
    offsets = sorted(int(h["streamrft.source.offset"]) for h in headers)
    assert len(set(offsets)) == len(offsets) == 30
    assert clients.lag(config.consumer_group("dlq-test"), topic) == 0
    clients.close()


def test_topic_creation_is_idempotent(run_config):
    config = run_config(topics={"rollouts": {"partitions": 5}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    created = clients.ensure_topics()
    assert sorted(created) == sorted(run_topics(config))
    assert clients.ensure_topics() == []
    topics = clients.admin().list_topics(timeout=10).topics
    assert len(topics[config.topic("rollouts")].partitions) == 5
    assert len(topics[config.topic("sync")].partitions) == 1
    reports = {r.name: r for r in clients.describe()}
    assert reports[config.topic("rollouts")].end_offsets_total == 0
    clients.close()


def test_sync_topic_is_compacted(run_config):
    from confluent_kafka.admin import ConfigResource

    config = run_config()
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    resource = ConfigResource(ConfigResource.Type.TOPIC, config.topic("sync"))
    described = clients.admin().describe_configs([resource])[resource].result()
    assert described["cleanup.policy"].value == "compact,delete"
    resource = ConfigResource(ConfigResource.Type.TOPIC, config.topic("experiences"))
    described = clients.admin().describe_configs([resource])[resource].result()
    assert int(described["max.message.bytes"].value) == 16 * 1024 * 1024
    clients.close()
