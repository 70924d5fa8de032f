"""Lag in records, as operators read it: transaction markers take offsets and are no lag. On the real broker, with
records written in transactions (each commit leaves a marker) and an aborted one."""
from __future__ import annotations

import pytest

from streamrft.kafka import KafkaClients
from streamrft.kafka.inspection import describe_groups, describe_topics
from streamrft.kafka.records_lag import count_records
from streamrft.schemas import Metric

pytestmark = pytest.mark.kafka


def _metric(i: int) -> Metric:
    return Metric(source="test", role="test", name="lag/probe", value=float(i), step=i)


def test_a_fully_processed_transactional_partition_shows_lag_0_and_records_count_records(run_config):
    config = run_config(topics={"metrics": {"partitions": 1}})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    topic, group = config.topic("metrics"), config.consumer_group("monitor")
    producer = clients.producer(transactional_id=f"{config.name}.lag-test")
    producer.init_transactions()
    for i in range(6):  # six transactions of two records: 12 records, 6 markers
        producer.raw.begin_transaction()
        producer.produce(topic, _metric(2 * i), partition=0)
        producer.produce(topic, _metric(2 * i + 1), partition=0)
        producer.raw.commit_transaction()
    producer.raw.begin_transaction()  # an aborted one: 2 records no read_committed reader gets, and its marker
    producer.produce(topic, _metric(100), partition=0)
    producer.produce(topic, _metric(101), partition=0)
    producer.raw.flush()  # written to the log, then aborted
    producer.raw.abort_transaction()
    end = clients.offsets(topic, "end")[(topic, 0)]
    assert end == 12 + 6 + 2 + 1

    reader = clients.consumer([topic], Metric, group, subscribe=False, dead_letters=False)
    reader.assign({(topic, 0): 0})
    read = []
    while len(read) < 12:
        read += reader.poll(timeout=1.0)
    reader.commit_offsets(reader.positions())  # as most roles do: after the last record, before its marker
    assert reader.positions() == {(topic, 0): 17}

    report = next(r for r in clients.describe() if r.name == topic)
    assert report.end_offsets_total == 21 and report.groups[group] == 0 and report.exact[group]
    assert clients.lag(group, topic) == 4  # offsets: the marker, the aborted pair and its marker

    # in the middle, at a marker (the log: r0 r1 M r2 r3 M ...): records 4..11 are left, with 4 markers
    reader.commit_offsets({(topic, 0): 5})
    report = next(r for r in clients.describe() if r.name == topic)
    assert report.groups[group] == 8
    admin = clients.admin()
    topics = describe_topics(admin, clients.probe(), [topic])
    (state,) = [g for g in describe_groups(admin, clients.offsets_reader, topics, group, clients.count_records)
                if g.group == group]
    (partition,) = state.partitions
    assert (partition.committed, partition.end, partition.lag, partition.offsets) == (5, 21, 8, 16)

    counted = clients.count_records({(topic, 0): (5, 21)})
    assert counted[(topic, 0)].records == 8 and counted[(topic, 0)].exact
    short = count_records(config.kafka, clients.bootstrap, {(topic, 0): (0, 21)}, cap=4)
    assert not short[(topic, 0)].exact and short[(topic, 0)].records >= 12  # capped: the rest as offsets
    reader.close()
    producer.close()
    clients.close()
