"""The embedded KRaft broker: it answers, transactions work, it never outlives its owner, and the
`streamrft broker` commands manage a shared one (one node, and a 3-node cluster). One session broker plus
short-lived ones (~3 s each, ~8 s for the cluster); bad cluster settings are refused before any JVM starts.
The cluster's failover is tested in test_cluster.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from streamrft.broker import EmbeddedBroker, check_replication, ensure_jars, kafka_for
from streamrft.broker.jars import kafka_home, parse_java_major
from streamrft.broker.placement import java_hash
from streamrft.broker.state import process_alive, read_state
from streamrft.config import EmbeddedBrokerConfig, load_config
from streamrft.errors import BrokerError, ConfigError

VERSION = load_config(env={}).broker.kafka_version


def _port(bootstrap: str) -> int:
    return int(bootstrap.rpartition(":")[2])


def _port_open(bootstrap: str) -> bool:
    try:
        socket.create_connection(("127.0.0.1", _port(bootstrap)), timeout=1).close()
        return True
    except OSError:
        return False


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


# -- no broker ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output, major", [
    ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment (build 17.0.15+6-Debian-1deb12u1)', 17),
    ('openjdk version "21" 2023-09-19\nOpenJDK 64-Bit Server VM (build 21+35-2513, mixed mode)', 21),
    ('java version "1.8.0_292"\nJava(TM) SE Runtime Environment (build 1.8.0_292-b10)', 8),
    ('openjdk version "22-ea" 2024-03-19', 22),
])
def test_java_version_parser(output: str, major: int) -> None:
    assert parse_java_major(output) == major


def test_old_java_is_refused_with_a_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrft.broker.jars import find_java

    fake = tmp_path / "jdk8" / "bin" / "java"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\necho \'java version "1.8.0_292"\' >&2\n')
    fake.chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk8"))
    with pytest.raises(BrokerError, match=r"Java 8; the embedded Kafka broker needs Java 17\+.*JAVA_HOME"):
        find_java()
    with pytest.raises(BrokerError, match="could not read the Java version"):
        parse_java_major("command not found")


def test_broker_nodes_is_one_or_a_cluster_of_three_to_five() -> None:
    assert (EmbeddedBrokerConfig().replication_factor, EmbeddedBrokerConfig().min_insync_replicas) == (1, 1)
    cluster = EmbeddedBrokerConfig(nodes=3)
    assert (cluster.replication_factor, cluster.min_insync_replicas) == (3, 2)
    assert EmbeddedBrokerConfig(nodes=5).replication_factor == 3
    with pytest.raises(ConfigError, match=r"broker\.nodes.*less available than 1 node\. Use 1, or 3"):
        load_config(overrides={"broker": {"nodes": 2}}, env={})
    for nodes in (0, 6):
        with pytest.raises(ConfigError, match=r"1 node or a cluster of 3 to 5.*kafka\.bootstrap_servers"):
            load_config(overrides={"broker": {"nodes": nodes}}, env={})


def test_topics_asking_for_more_replicas_than_nodes_are_refused_before_the_broker_starts() -> None:
    config = load_config(overrides={"name": "r", "topics": {"experiences": {"replication_factor": 3}}}, env={})
    with pytest.raises(ConfigError, match=r"rft\.r\.experiences asks for replication_factor 3 and the embedded "
                                          r"broker has 1 node.*set broker\.nodes to 3"):
        check_replication(config, 1)
    check_replication(config, 3)


def test_what_the_machine_cannot_hold_is_refused_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match=r"broker\.nodes 3 × broker\.heap 4096g.*lower broker\.heap"):
        EmbeddedBroker(EmbeddedBrokerConfig(nodes=3, heap="4096g"), data_dir=tmp_path).start()
    with pytest.raises(BrokerError, match="not a JVM heap size"):
        EmbeddedBroker(EmbeddedBrokerConfig(heap="lots"), data_dir=tmp_path).start()


@pytest.mark.parametrize("held, nodes, holds",
                         [("kraft", 3, "1-node"), ("node-3", 1, "3-node"), ("node-5", 3, "5-node")])
def test_a_data_dir_of_a_broker_of_another_size_is_refused(tmp_path: Path, held: str, nodes: int, holds: str) -> None:
    """A static KRaft quorum cannot grow or shrink: the data dir of another size is refused, not half-used."""
    (tmp_path / held).mkdir()
    with pytest.raises(BrokerError, match=f"holds the data of a {holds} broker and broker.nodes is {nodes}"):
        EmbeddedBroker(EmbeddedBrokerConfig(nodes=nodes), data_dir=tmp_path).start()
    assert (tmp_path / held).exists()


@pytest.mark.parametrize("text, expected", [("", 0), ("a", 97), ("hello", 99162322), ("polygenelubricants", -2**31),
                                            ("rft.chaos.rollout.w0", -1787827566), ("é€𝄞", 16751501)])
def test_ids_are_placed_as_kafka_places_them(text: str, expected: int) -> None:
    """Java's String.hashCode, which Kafka's TransactionStateManager places transactional ids by (the expected
    values are Java's own)."""
    assert java_hash(text) == expected


def test_configured_cluster_is_used_as_is() -> None:
    config = load_config(overrides={"kafka": {"bootstrap_servers": "kafka-1:9092"}}, env={})
    with kafka_for(config) as bootstrap:
        assert bootstrap == "kafka-1:9092"


# -- the session broker -------------------------------------------------------------------------------------------


@pytest.mark.kafka
def test_broker_answers_metadata(kafka_bootstrap: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = f"t-meta-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(timeout=30)
    # CreateTopics returns once the controller has committed; the broker's metadata cache follows moments later
    assert _wait_until(lambda: topic in admin.list_topics(timeout=10).topics, timeout=10)
    metadata = admin.list_topics(timeout=10)
    assert len(metadata.brokers) >= 1
    assert len(metadata.topics[topic].partitions) == 3


@pytest.mark.kafka
def test_transactions_commit_and_abort(kafka_bootstrap: str) -> None:
    """A read_committed consumer sees the committed record and never the aborted one."""
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"t-txn-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=30)

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"txn-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"k", value=b"aborted")
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"k", value=b"committed")
    producer.commit_transaction(30)

    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    seen = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and not seen:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                seen.append(msg.value())
        # anything after the committed record would be the aborted one leaking through
        extra = consumer.poll(1.0)
    finally:
        consumer.close()
    assert seen == [b"committed"]
    assert extra is None or extra.error() is not None


# -- brokers of their own -----------------------------------------------------------------------------------------


@pytest.mark.kafka
def test_second_broker_gets_other_ports_and_stop_cleans_up(kafka_bootstrap: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "second"
    broker = EmbeddedBroker(data_dir=data_dir).start()
    try:
        pid, bootstrap = broker.pid, broker.bootstrap_servers
        assert _port(bootstrap) != _port(kafka_bootstrap)
        assert process_alive(pid, str(data_dir))
        assert (data_dir / "broker.log").read_text().count("Kafka Server started") == 1
    finally:
        broker.stop()
    assert not process_alive(pid, str(data_dir))
    assert not _port_open(bootstrap)
    assert not data_dir.exists()
    with pytest.raises(BrokerError, match="not running"):
        broker.bootstrap_servers


@pytest.mark.kafka
def test_broker_dies_with_its_owner(tmp_path: Path) -> None:
    """Even a SIGKILLed owner leaves no broker behind: the watchdog stops it and removes its temporary data."""
    script = textwrap.dedent("""
        import time
        from streamrft.broker import EmbeddedBroker
        broker = EmbeddedBroker().start()
        print(broker.pid, broker.data_dir, broker.bootstrap_servers, flush=True)
        time.sleep(120)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid, data_dir, bootstrap = owner.stdout.readline().split()
        assert process_alive(int(pid), data_dir) and _port_open(bootstrap)
    finally:
        owner.kill()
        owner.wait()
    assert _wait_until(lambda: not process_alive(int(pid), data_dir), timeout=30)
    assert _wait_until(lambda: not Path(data_dir).exists(), timeout=10)


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A private STREAMRFT_CACHE_DIR (own state file) that links to the already-resolved jars."""
    ensure_jars(VERSION, quiet=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"kafka-{VERSION}").symlink_to(kafka_home(VERSION))
    monkeypatch.setenv("STREAMRFT_CACHE_DIR", str(cache))
    return {**os.environ, "STREAMRFT_CACHE_DIR": str(cache), "STREAMRFT_LOG_LEVEL": "WARNING"}


@pytest.mark.kafka
@pytest.mark.parametrize("nodes", [1, 3])
def test_cli_start_status_stop(isolated_cache: dict[str, str], nodes: int) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streamrft.cli", "broker", *args], env=isolated_cache,
                              capture_output=True, text=True, timeout=120)

    assert cli("status").returncode == 1
    started = cli("start", "--nodes", str(nodes))
    try:
        assert started.returncode == 0, started.stderr
        bootstrap = started.stdout.strip().splitlines()[-1]
        assert len(bootstrap.split(",")) == nodes and all(_port_open(address) for address in bootstrap.split(","))

        again = cli("start")
        assert again.returncode == 1 and "already running" in again.stderr

        status = cli("status")
        assert status.returncode == 0 and status.stdout.strip() == bootstrap
        assert "0 topics" in status.stderr
        assert nodes == 1 or "3 of 3 nodes up" in " ".join(status.stderr.split())  # rich wraps long lines

        # every command finds this broker instead of starting its own
        with kafka_for(load_config(env={})) as found:
            assert found == bootstrap
        state = read_state()
        assert state is not None and state.bootstrap_servers == bootstrap
    finally:
        stopped = cli("stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stderr
    assert not any(_port_open(address) for address in bootstrap.split(","))
    assert len(state.all_pids) == nodes
    assert not any(process_alive(pid, state.data_dir) for pid in state.all_pids)
    assert not Path(state.data_dir).exists()
    assert read_state() is None
    assert cli("status").returncode == 1


def test_cli_refuses_a_two_node_cluster_with_the_reason(isolated_cache: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "streamrft.cli", "broker", "start", "--nodes", "2"],
                          env=isolated_cache, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--nodes 2: 2 nodes make a KRaft quorum that stops when either node stops" in done.stderr
    assert read_state() is None


@pytest.mark.kafka
def test_refuses_a_data_dir_with_foreign_files(tmp_path: Path) -> None:
    """stop() deletes the data dir, so a directory holding anything else is never adopted."""
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(BrokerError, match="notes.txt"):
        EmbeddedBroker(data_dir=tmp_path).start()
    assert (tmp_path / "notes.txt").read_text() == "precious"
