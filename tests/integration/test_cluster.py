"""The replicated embedded cluster (``broker.nodes: 3``): it elects a quorum and replicates every topic, a role's
acks=all writes go on through a broker's death (the broker back with an empty disk), roles wait through
min.insync.replicas refusals and resume, and on a secured cluster the loop runs with a principal per role.

One 3-node cluster for the module, secured (SASL/SCRAM, so every test also shows security working across nodes),
384 MB heaps. A test that takes a node down brings it back and waits until every replica is in sync, so the next
one starts on a whole cluster. The harness ignores KAFKA_BOOTSTRAP: it must kill brokers of its own."""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from streamrft.broker import EmbeddedBroker
from streamrft.broker.placement import QUORUM_STATE
from streamrft.config import EmbeddedBrokerConfig, load_config
from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.consumers.trainer import Trainer
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.errors import AuthorizationError
from streamrft.kafka import FatalTransactionError, KafkaClients, TransactionFailed, Transactor
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal, Task

from .chaos_harness import chaos_module
from .roles import RoleThread, produce_tasks, wait_for, wait_for_explorer_step
from .test_security import SecuredRun

pytestmark = [pytest.mark.kafka]

INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = EmbeddedBrokerConfig(nodes=3, heap="384m", security="sasl_scram")
    with EmbeddedBroker(config, data_dir=tmp_path_factory.mktemp("cluster")) as broker:
        yield broker


def _admin_config(cluster: EmbeddedBroker, **overrides):
    """A run with a fresh name on the cluster, as its admin."""
    config = load_config(overrides={"name": f"c{uuid.uuid4().hex[:8]}", **overrides}, env={})
    return config.on_cluster(cluster.bootstrap_servers, cluster.security.admin)


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _topic_configs(cluster: EmbeddedBroker, names: list[str], key: str) -> dict[str, str]:
    """Each topic's ``key``; asked again while a broker that answers has not yet learnt of a topic created a
    moment ago (metadata reaches the nodes of a cluster one after the other)."""
    deadline = time.monotonic() + 30
    while True:
        found = cluster.admin().describe_configs([ConfigResource("topic", name) for name in names],
                                                 request_timeout=30)
        try:
            return {resource.name: future.result()[key].value for resource, future in found.items()}
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _set_min_insync(cluster: EmbeddedBroker, names: list[str], value: str) -> None:
    resources = [ConfigResource("topic", name, incremental_configs=[
        ConfigEntry("min.insync.replicas", value, incremental_operation=AlterConfigOpType.SET)]) for name in names]
    for future in cluster.admin().incremental_alter_configs(resources, request_timeout=30).values():
        future.result()


def test_the_cluster_elects_a_quorum_and_replicates_every_topic(cluster):
    config = _admin_config(cluster)
    clients = KafkaClients(config, cluster.bootstrap_servers)
    try:
        created = clients.ensure_topics()
        assert len(created) == len(config.topic_layouts())
        metadata = cluster.admin().list_topics(timeout=10)
        assert sorted(metadata.brokers) == [1, 2, 3]
        # one KRaft quorum of three voters, every node a voter, and one of them leads it
        for node in cluster.nodes:
            state = json.loads((node.storage / QUORUM_STATE).read_text())
            assert sorted(v["voterId"] for v in state["currentVoters"]) == [1, 2, 3], node
        assert cluster.controller() in (1, 2, 3)
        # the run's topics and the internal ones: three replicas, all in sync, leaders spread over the nodes
        leaders = Counter()
        for name in [*created, *INTERNAL_TOPICS]:
            for partition in metadata.topics[name].partitions.values():
                assert sorted(partition.replicas) == [1, 2, 3], (name, partition.id)
                assert sorted(partition.isrs) == [1, 2, 3], (name, partition.id)
                leaders[partition.leader] += 1
        assert set(leaders) == {1, 2, 3}, leaders
        # an acknowledged write is on two replicas at least
        names = [config.topic("experiences"), config.topic("sync"), *INTERNAL_TOPICS]
        assert _topic_configs(cluster, names, "min.insync.replicas") == {name: "2" for name in names}
    finally:
        clients.close()


def test_a_role_writes_with_acks_all_through_a_broker_death(cluster):
    """Units of work keep committing (acks=all, one transaction each) while the leader of the partition they
    write is SIGKILLed; the node comes back with an empty disk and copies its replicas back. Every committed
    record is there once, and nothing that was not committed."""
    config = _admin_config(cluster, topics={"tasks": {"partitions": 3}})
    clients = KafkaClients(config, cluster.bootstrap_servers)
    clients.ensure_topics()
    topic = config.topic("tasks")
    transactor = Transactor(clients.producer(transactional_id=f"{config.name}.writer"))
    committed: list[str] = []
    slowest = [0.0]
    errors: list[BaseException] = []
    stop = threading.Event()

    def write() -> None:
        try:
            unit = 0
            while not stop.is_set():
                ids = [f"u{unit}-p{p}" for p in range(3)]
                began = time.monotonic()
                transactor.run(lambda producer: [producer.produce(topic, Task(task_id=task_id, workflow="w",
                                                                               payload="{}"), partition=p)
                                                 for p, task_id in enumerate(ids)], f"unit {unit}")
                slowest[0] = max(slowest[0], time.monotonic() - began)
                committed.extend(ids)
                unit += 1
        except BaseException as exc:  # the test fails with it below
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        _wait(lambda: len(committed) >= 30 or errors, 60, "no unit committed on the whole cluster")
        victim = cluster.leader_of(topic, 0)
        cluster.kill_node(victim)
        before = len(committed)
        _wait(lambda: len(committed) >= before + 30 or errors, 60, f"writes stopped with node {victim} down")
        cluster.start_node(victim, empty_disk=True)
        cluster.wait_in_sync(timeout=90)
    finally:
        stop.set()
        writer.join(90)
    assert not errors, errors
    records = [clients.serde.decode(raw.value, topic, Task).task_id
               for raw in read_to_end(config.kafka, cluster.bootstrap_servers, topic)]
    assert Counter(records) == Counter(committed)  # none lost, none twice, nothing uncommitted
    assert slowest[0] < 30, f"a unit took {slowest[0]:.1f} s through the failover"
    # the node that lost its disk holds every replica of the topic again
    partitions = cluster.admin().list_topics(topic, timeout=10).topics[topic].partitions.values()
    assert all(victim in p.isrs for p in partitions)
    transactor.producer.close()
    clients.close()


def test_a_transaction_the_coordinator_timed_out_is_redone_on_a_new_client(cluster):
    """librdkafka #3297, as a worker met it in bench/chaos.py when its partition leader died: a unit's records
    cannot be written (here its topic asks for more in-sync replicas than it has), its messages time out with its
    1 s transaction, the coordinator aborts the timed-out transaction, and the producer's own abort is answered
    INVALID_TXN_STATE, fatal for that client. No newer instance fenced it, so the Transactor carries on with a new
    client (same transactional.id) and the same unit, which commits once the topic takes writes again."""
    config = _admin_config(cluster)
    clients = KafkaClients(config, cluster.bootstrap_servers)
    clients.ensure_topics()
    topic = config.topic("tasks")
    _set_min_insync(cluster, [topic], "4")  # more than its 3 replicas: every acks=all write is refused
    transactor = Transactor(clients.producer(transactional_id=f"{config.name}.slow",
                                             extra={"transaction.timeout.ms": 1000}))
    attempts: list[str] = []

    def produce(producer) -> None:
        attempts.append(f"t{len(attempts)}")
        producer.produce(topic, Task(task_id=attempts[-1], workflow="w", payload="{}"))
        if len(attempts) == 1:
            # past the 1 s timeout, and the coordinators look for such transactions every second on the cluster
            time.sleep(4)
            _set_min_insync(cluster, [topic], "2")

    transactor.run(produce, "the unit held up by an outage")
    assert transactor.replaced == 1 and len(attempts) >= 2, (transactor.replaced, attempts)
    records = [clients.serde.decode(raw.value, topic, Task).task_id
               for raw in read_to_end(config.kafka, cluster.bootstrap_servers, topic)]
    assert records == attempts[-1:]  # the unit once, from the attempt that committed
    clients.close()


def test_a_newer_instance_still_stops_the_older_one(cluster):
    """The complement: a transaction younger than its timeout that is fenced was fenced by a newer instance with
    the same transactional.id, and the older one stops rather than take the id back."""
    config = _admin_config(cluster)
    clients = KafkaClients(config, cluster.bootstrap_servers)
    clients.ensure_topics()
    transactional_id = f"{config.name}.twice"
    older = Transactor(clients.producer(transactional_id=transactional_id))

    def produce(producer) -> None:
        producer.produce(config.topic("tasks"), Task(task_id="t", workflow="w", payload="{}"))
        Transactor(clients.producer(transactional_id=transactional_id))  # a newer instance starts meanwhile

    with pytest.raises(FatalTransactionError, match="another instance with the same transactional.id"):
        older.run(produce, "the older instance's unit")
    assert older.replaced == 0
    clients.close()


def test_a_member_the_group_let_go_fails_its_unit_at_once(cluster):
    """A member whose group moved on without it (here: it did not poll within max.poll.interval.ms, as a worker
    stuck committing through a coordinator's failover does not) cannot commit its unit's offsets, however often it
    tries: the Transactor says so at once, not after a minute of attempts that each leave an aborted copy."""
    config = _admin_config(cluster)
    clients = KafkaClients(config, cluster.bootstrap_servers)
    clients.ensure_topics()
    topic = config.topic("tasks")
    producer = clients.producer()
    producer.produce(topic, Task(task_id="t0", workflow="w", payload="{}"))
    producer.flush()
    consumer = clients.consumer([topic], Task, config.consumer_group("slow"), dead_letters=False,
                                extra={"max.poll.interval.ms": 6000, "session.timeout.ms": 6000,
                                       "heartbeat.interval.ms": 1000})
    transactor = Transactor(clients.producer(transactional_id=f"{config.name}.slow-member"), consumer)
    _wait(lambda: consumer.poll(max_records=10, timeout=0.5), 60, "the member read nothing")
    time.sleep(9)  # no poll for longer than max.poll.interval.ms: librdkafka leaves the group
    began = time.monotonic()
    with pytest.raises(TransactionFailed, match="the consumer group no longer has this member"):
        transactor.run(lambda p: p.produce(config.topic("metrics"), Task(task_id="m", workflow="w", payload="{}")),
                       "the late member's unit")
    assert time.monotonic() - began < 15 and transactor.aborted == 1
    assert clients.committed(config.consumer_group("slow"), topic) == {}
    consumer.close()
    clients.close()


@pytest.fixture(scope="module")
def loop_through_refusals(cluster, tiny_model_dir, tmp_path_factory):
    """The loop (explorer, rollout worker, trainer), each role as its own principal, while every write to the
    run's topics is refused with NOT_ENOUGH_REPLICAS for OUTAGE_S: one node is SIGKILLed while the topics ask
    for min.insync.replicas 3. (Two of three nodes down, which refuses them at min.insync.replicas 2, takes the
    KRaft quorum with them: measured, writes then time out instead of being refused.) Returns what the tests
    check."""
    tmp = tmp_path_factory.mktemp("loop")
    steps, outage_s = 6, 12.0
    run = SecuredRun(cluster, tmp / "credentials",
                     model={"path": str(tiny_model_dir)},
                     explorer={"batch_size": 2, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
                     rollout={"engine": "fake", "metrics_port": None},
                     trainer={"checkpoint_dir": str(tmp / "ckpt"), "metrics_port": None, "device": "cpu",
                              "total_steps": steps, "micro_batch_size": 8})
    config = run.admin_config
    produce_tasks(run.clients("tasks"), run.config("tasks"), make_arithmetic_tasks(2 * steps, seed=3))
    roles = {
        "worker": RoleThread("worker", lambda stop: RolloutWorker(run.config("rollout"), run.clients("rollout"),
                                                                  stop, "w0")),
        "explorer": RoleThread("explorer", lambda stop: Explorer(run.config("explorer"), run.clients("explorer"),
                                                                 stop)),
        "trainer": RoleThread("trainer", lambda stop: Trainer(run.config("trainer"), run.clients("trainer"), stop)),
    }
    outcome = {"run": run, "steps": steps}
    try:
        for role in roles.values():
            role.start()
        wait_for_explorer_step(roles["explorer"], 1, 180)
        # the outage: every write to the run's topics needs 3 in-sync replicas, and one node is gone
        topics = sorted(config.topic_layouts())
        _set_min_insync(cluster, topics, "3")
        # the probe's raw writes go to a topic of their own: one the leader accepts before it learns of the dead
        # node must not land on a topic the run's checks decode
        probe_topic = _probe_topic(cluster)
        victim = cluster.leader_of(config.topic("experiences"), 0)
        cluster.kill_node(victim)
        began, step_at_kill = time.monotonic(), roles["explorer"].role.state.finished_step
        _wait(lambda: len(cluster.admin().list_topics(timeout=10).brokers) == 2, 30, "the dead node stays registered")
        outcome["refusal"] = _refused_write(cluster, probe_topic)
        time.sleep(max(0.0, outage_s - (time.monotonic() - began)))
        outcome["steps_in_outage"] = roles["explorer"].role.state.finished_step - step_at_kill
        outcome["alive_after_outage"] = {name: role.thread.is_alive() and role.error is None
                                         for name, role in roles.items()}
        cluster.start_node(victim)
        cluster.wait_in_sync(timeout=90)
        wait_for(roles["trainer"], [roles["worker"], roles["explorer"]], 240)
        wait_for(roles["explorer"], [roles["worker"]], 60)
        outcome["trained"] = roles["trainer"].result
        outcome["explorer_done"] = roles["explorer"].result.done
        outcome["observed"] = chaos_module().observe_topics(config, cluster.bootstrap_servers, tmp / "ckpt")
        _set_min_insync(cluster, topics, "2")
        yield outcome
    finally:
        for role in roles.values():
            role.stop.request()
        for role in roles.values():
            role.thread.join(60)
        run.close()


def _probe_topic(cluster: EmbeddedBroker) -> str:
    """A topic of its own for :func:`_refused_write`, replicated to every node and, like the run's topics in
    the outage, asking for 3 in-sync replicas."""
    name = f"probe-{uuid.uuid4().hex[:8]}"
    topic = NewTopic(name, num_partitions=1, replication_factor=3, config={"min.insync.replicas": "3"})
    for future in cluster.admin().create_topics([topic], request_timeout=30).values():
        future.result()
    return name


def _refused_write(cluster: EmbeddedBroker, topic: str, attempts: int = 3) -> list[str]:
    """What the cluster answers acks=all writes to ``topic`` now, as a bare producer sees them (no retries),
    until one is refused for want of in-sync replicas (the partition leader may learn of the shrunk ISR a moment
    after the controller fenced the node)."""
    answers: list[str] = []
    producer = Producer({**cluster.client_properties(), "acks": "all", "enable.idempotence": False, "retries": 0,
                         "message.timeout.ms": 5_000})
    for _ in range(attempts):
        delivered: list[KafkaError | None] = []
        producer.produce(topic, b"probe", on_delivery=lambda err, msg: delivered.append(err))
        producer.flush(10)
        answers.append(delivered[0].name() if delivered and delivered[0] is not None else "accepted")
        if answers[-1] == "NOT_ENOUGH_REPLICAS":
            break
    return answers


@pytest.mark.model
def test_min_insync_refusals_make_roles_wait_and_resume_with_nothing_lost(loop_through_refusals):
    outcome = loop_through_refusals
    assert "NOT_ENOUGH_REPLICAS" in outcome["refusal"]  # the cluster refused acks=all writes meanwhile
    assert outcome["steps_in_outage"] <= 1  # the loop waited (a step may finish as the outage begins)...
    assert outcome["alive_after_outage"] == {"worker": True, "explorer": True, "trainer": True}  # ...no role died
    steps = outcome["steps"]
    assert outcome["trained"] == steps and outcome["explorer_done"]  # ...and resumed to the end
    verdict = chaos_module().check(outcome["observed"], [], steps)
    assert verdict.violations == {}
    figures = verdict.figures
    assert figures["duplicates"] == 0 and figures["lost"] == 0
    assert figures["tasks"] == figures["requests"] == 2 * steps
    assert figures["trained"] == figures["experiences"] == 2 * steps * 4  # the audit trains every eid once


@pytest.mark.model
def test_the_loop_runs_with_a_principal_per_role_on_a_secured_cluster(loop_through_refusals):
    """Users and ACLs live in the cluster's metadata: every node authenticates the roles' SCRAM users and
    enforces their ACLs, whichever node leads what they touch."""
    run = loop_through_refusals["run"]
    assert loop_through_refusals["trained"] == loop_through_refusals["steps"]
    for role in ("explorer", "rollout", "trainer", "tasks"):
        assert run.config(role).kafka.sasl_username == f"{run.name}.{role}"
    signal = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=1, method=SyncMethod.OBJECT_STORE)
    producer = run.clients("rollout").producer()
    producer.produce(run.admin_config.topic("sync"), signal)
    with pytest.raises(AuthorizationError, match=f"User:{run.name}.rollout WRITE on topic"):
        producer.flush(30)  # a worker may not publish weights, on any node
