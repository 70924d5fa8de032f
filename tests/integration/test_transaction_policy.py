"""The one abort policy of every role's transactions: any exception inside a transaction aborts it (nothing of
it is visible to read_committed readers) and the producer goes on with the next one; the consumed offsets are
committed only with a transaction that commits."""
from __future__ import annotations

import pytest

from streamrft.kafka import KafkaClients, Transactor
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import Metric, Task

pytestmark = pytest.mark.kafka


def test_an_exception_inside_a_transaction_aborts_it_and_the_next_one_commits(run_config):
    config = run_config()
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    tasks, metrics = config.topic("tasks"), config.topic("metrics")
    producer = clients.producer()
    for i in range(3):
        producer.produce(tasks, Task(task_id=f"t{i}", workflow="w", payload="{}"))
    producer.flush()
    consumer = clients.consumer([tasks], Task, config.consumer_group("policy"))
    transactor = Transactor(clients.producer(transactional_id=f"{config.name}.policy"), consumer)
    items = []
    while len(items) < 3:
        items += consumer.poll(max_records=10, timeout=1.0)

    def failing(p):
        p.produce(metrics, Metric(source="s", role="r", name="half-done", value=1.0, step=0))
        raise ValueError("a bug in the unit of work")

    with pytest.raises(ValueError, match="a bug"):
        transactor.run(failing, "the failing unit")
    assert transactor.aborted == 1 and clients.committed(config.consumer_group("policy"), tasks) == {}

    transactor.run(lambda p: p.produce(metrics, Metric(source="s", role="r", name="done", value=1.0, step=0)),
                   "the next unit")
    names = [clients.serde.decode(raw.value, metrics, Metric).name
             for raw in read_to_end(config.kafka, clients.bootstrap, metrics)]
    assert names == ["done"]  # the aborted record is invisible to read_committed readers
    assert clients.committed(config.consumer_group("policy"), tasks) == {(tasks, 0): 3}  # offsets went with the commit
    consumer.close()
    clients.close()


def test_a_stuck_transaction_call_is_abandoned_with_its_client_and_the_unit_commits(run_config, monkeypatch):
    """librdkafka #5456: send_offsets_to_transaction can block past its timeout. Simulated: the first client's
    call never returns; the Transactor replaces the client (same transactional.id) and commits the unit."""
    import threading

    from streamrft.kafka import transaction

    monkeypatch.setattr(transaction, "STUCK_GRACE_S", 0.5)
    config = run_config()
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    metrics = config.topic("metrics")
    producer = clients.producer(transactional_id=f"{config.name}.stuck")
    transactor = Transactor(producer, timeout=2.0)
    stuck_client = producer.raw
    never = threading.Event()
    real_commit = type(stuck_client).commit_transaction

    class Stuck:
        """The first client, whose commit blocks for ever (until the test ends)."""

        def __getattr__(self, name):
            return getattr(stuck_client, name)

        def commit_transaction(self, timeout):
            never.wait(30)
            return real_commit(stuck_client, timeout)

    producer._producer = Stuck()
    try:
        transactor.run(lambda p: p.produce(metrics, Metric(source="s", role="r", name="once", value=1.0, step=0)),
                       "a unit whose commit blocks")
    finally:
        never.set()
    assert producer.raw is not stuck_client and not isinstance(producer.raw, Stuck)
    names = [clients.serde.decode(raw.value, metrics, Metric).name
             for raw in read_to_end(config.kafka, clients.bootstrap, metrics)]
    assert names == ["once"]  # the stuck client's transaction was fenced and aborted: the record once
    clients.close()
