"""Experiences near the topic's size limit pass through the client layer with its default fetch sizes
(librdkafka's: 1 MB per partition, 50 MB per fetch), mixed with small ones, in order."""
from __future__ import annotations

import time

import numpy as np
import pytest

from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32

pytestmark = pytest.mark.kafka


def _experience(i: int, tokens: int) -> Experience:
    rng = np.random.default_rng(i)
    return Experience(eid=f"r/{i}", group_id="r", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=i,
                      model_version=0, tokens=pack_i32(rng.integers(0, 50_000, tokens, dtype=np.int32)),
                      prompt_length=0, logprobs=pack_f32(rng.standard_normal(tokens).astype(np.float32)),
                      reward=float(i))


def test_records_larger_than_a_partition_fetch_arrive_whole_and_in_order(run_config):
    config = run_config()
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    topic = config.topic("experiences")
    # ~12 MB records (1.5M tokens + 1.5M logprobs) between small ones, all with one key: one partition, in order
    sizes = [16, 1_500_000, 16, 16, 1_500_000, 1_500_000, 16]
    sent = [_experience(i, n) for i, n in enumerate(sizes)]
    producer = clients.producer()
    for record in sent:
        producer.produce(topic, record)
    producer.flush()

    consumer = clients.consumer([topic], Experience, config.consumer_group("large"))
    got: list[Experience] = []
    deadline = time.monotonic() + 60
    while len(got) < len(sent):
        assert time.monotonic() < deadline, f"consumer stalled after {len(got)} of {len(sent)} records"
        got += [d.record for d in consumer.poll(max_records=10, timeout=1.0)]
    consumer.close()
    clients.close()

    assert [r.run_index for r in got] == list(range(len(sizes)))
    for a, b in zip(got, sent):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert max(len(r.tokens) + len(r.logprobs) for r in got) > 11 * 1024 * 1024
