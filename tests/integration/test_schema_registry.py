"""The embedded schema registry (Apicurio Registry on loopback, Confluent API): a producer in another process,
written only against the registry and the contract file, feeds a run that rolls its tasks out and trains on them;
a schema that breaks the compatibility rule is refused with a message that says what to do."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_topic
from streamrft.schemas import Experience, RolloutRequest, Task

from .roles import RoleThread, read_all, wait_for

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
PRODUCER = Path(__file__).with_name("registry_task_producer.py")
TASK_AVSC = ROOT / "schemas" / "Task.avsc"


@pytest.fixture(scope="module")
def registry():
    """One registry for the module; the subjects of each test are its run's own topics."""
    import shutil

    from streamrft.registry import EmbeddedRegistry, registry_ready

    if not registry_ready("3.0.9"):
        pytest.skip("Apicurio Registry is not resolved; run `streamrft registry setup` (scripts/setup.sh --dev does)")
    if shutil.which("java") is None:
        pytest.skip("the embedded registry needs Java 17+")
    with EmbeddedRegistry() as server:
        print(f"\nregistry started in {server.startup_s:.1f} s, RSS {server.rss_bytes() / 2**20:.0f} MiB")
        yield server


def _registry_client(url: str):
    from confluent_kafka.schema_registry import SchemaRegistryClient

    return SchemaRegistryClient({"url": url})


def test_the_outside_producer_uses_only_the_registry_and_the_contract():
    tree = ast.parse(PRODUCER.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not [name for name in imported if name.split(".")[0] == "streamrft"]
    assert any(name.startswith("confluent_kafka.schema_registry") for name in imported)


@pytest.mark.model
def test_tasks_from_a_producer_in_another_process_are_rolled_out_and_trained(registry, run_config, tiny_model_dir,
                                                                             tmp_path):
    from streamrft.consumers.explorer import Explorer
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.consumers.trainer import Trainer

    steps, batch = 2, 2
    config = run_config(
        schema_registry={"url": registry.url}, model={"path": str(tiny_model_dir)},
        sync={"style": "fixed", "interval": 1},
        explorer={"batch_size": batch, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
        rollout={"sampling": {"max_tokens": 3}, "metrics_port": None},
        trainer={"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                 "micro_batch_size": 8, "total_steps": steps, "save_interval": 100})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    tasks_topic = config.topic("tasks")

    outside = subprocess.run([sys.executable, str(PRODUCER), registry.url, config.kafka.bootstrap_servers,
                              tasks_topic, str(TASK_AVSC), str(steps * batch)],
                             capture_output=True, text=True, timeout=60)
    assert outside.returncode == 0, outside.stdout + outside.stderr
    raw = list(read_topic(config.kafka, config.kafka.bootstrap_servers, tasks_topic, idle_timeout=1.0))
    assert len(raw) == steps * batch and all(r.value[0] == 0 for r in raw)  # Confluent framing: magic byte 0

    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    trainer = RoleThread("trainer", lambda stop: Trainer(config, clients, stop)).start()
    try:
        wait_for(trainer, [worker, explorer], 240)
        wait_for(explorer, [worker], 60)
    finally:
        for role in (worker, explorer, trainer):
            role.stop.request()
        worker.join(60)

    assert trainer.result == steps
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest, idle=0.5)
    assert sorted(r.task.task_id for r in requests) == [f"outside-{i}" for i in range(steps * batch)]
    assert all(json.loads(r.task.payload)["answer"] == 3 * int(r.task.task_id.split("-")[1]) + 4 for r in requests)
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=0.5)
    assert len(experiences) == steps * batch * 4 and {e.task_id for e in experiences} == {
        f"outside-{i}" for i in range(steps * batch)}
    # every role wrote through the registry: its contracts are registered under the run's subjects
    subjects = set(_registry_client(registry.url).get_subjects())
    assert {f"{config.topic(name)}-value" for name in ("tasks", "rollouts", "experiences", "results")} <= subjects
    clients.close()


def _incompatible_task_schema() -> str:
    """Task.avsc with task_id an int: records written with the contract cannot be read with it."""
    schema = json.loads(TASK_AVSC.read_text())
    for field in schema["fields"]:
        if field["name"] == "task_id":
            field["type"] = "int"
    return json.dumps(schema)


def test_a_schema_that_breaks_backward_compatibility_is_refused(registry, run_config):
    """The subject holds the contract (registered by a streamrft producer); a Task schema whose task_id became
    an int is refused by the registry."""
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    config = run_config(schema_registry={"url": registry.url})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    topic = config.topic("tasks")
    clients.serde.encode(Task(task_id="t0", workflow="arithmetic", payload="{}"), topic)
    with pytest.raises(SchemaRegistryError) as refused:
        _registry_client(registry.url).register_schema(f"{topic}-value", Schema(_incompatible_task_schema(), "AVRO"))
    assert refused.value.http_status_code == 409 and "incompatible" in refused.value.error_message.lower()
    clients.close()


def test_a_producer_whose_contract_breaks_the_subject_gets_a_message_that_says_what_to_do(registry, run_config):
    """The subject holds another Task (task_id an int); a streamrft producer's Task is refused, and the error
    names the record type, the subject and the fix."""
    from confluent_kafka.schema_registry import Schema

    from streamrft.errors import SchemaIncompatibleError

    config = run_config(schema_registry={"url": registry.url})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    topic = config.topic("tasks")
    _registry_client(registry.url).register_schema(f"{topic}-value", Schema(_incompatible_task_schema(), "AVRO"))
    with pytest.raises(SchemaIncompatibleError) as refused:
        clients.serde.encode(Task(task_id="t0", workflow="arithmetic", payload="{}"), topic)
    message = str(refused.value)
    assert "Task schema" in message and f"'{topic}-value'" in message
    assert "compatibility rule" in message and "default" in message and "schemas/Task.avsc" in message
    clients.close()


def test_url_embedded_starts_a_registry_for_the_run_and_a_role_alone_is_told_what_to_set(run_config, tmp_path):
    """What `streamrft run` does with `schema_registry.url: embedded`: the run's config gets the started registry's
    address (the roles get it in their environment), no JVM is left when it ends, and its schemas stay in the
    run's directory for a --resume; without `streamrft run` the word `embedded` is no address, and the error says
    what to set."""
    import urllib.request

    from streamrft.commands.run import role_environment
    from streamrft.errors import ConfigError
    from streamrft.registry import registry_ready
    from streamrft.registry.for_run import REGISTRY_URL_ENV, registry_for

    if not registry_ready("3.0.9"):
        pytest.skip("Apicurio Registry is not resolved; run `streamrft registry setup` (scripts/setup.sh --dev does)")
    config = run_config(schema_registry={"url": "embedded"}, monitor={"output_dir": str(tmp_path / "{name}")})
    task = Task(task_id="t0", workflow="arithmetic", payload="{}")
    with pytest.raises(ConfigError, match=REGISTRY_URL_ENV):
        KafkaClients(config, config.kafka.bootstrap_servers).serde.encode(task, config.topic("tasks"))
    with registry_for(config) as on_registry:
        url = on_registry.schema_registry.url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/apis/ccompat/v7")
        with urllib.request.urlopen(f"{url}/config", timeout=5) as answer:
            assert json.loads(answer.read())["compatibilityLevel"] == "BACKWARD"
        assert role_environment("127.0.0.1:9092", url)[REGISTRY_URL_ENV] == url
        written = KafkaClients(on_registry, config.kafka.bootstrap_servers).serde.encode(task, config.topic("tasks"))
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/subjects", timeout=2)
    with registry_for(config) as resumed:  # a new JVM on the run's schema store: the record's id still resolves
        clients = KafkaClients(resumed, config.kafka.bootstrap_servers)
        assert clients.serde.decode(written, config.topic("tasks"), Task).task_id == "t0"


def test_an_evolved_writer_is_accepted_by_the_registry_and_read_in_either_framing(registry):
    """A foreign producer evolves Task (a field added with a default; the fields the reader has defaults for
    left out): the registry's BACKWARD rule accepts it under the subject that holds the contract, and a
    streamrft reader reads its records, Confluent-framed by schema id and single-object-framed by fingerprint
    (looked up among the subject's versions)."""
    import uuid

    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from streamrft.config import SchemaRegistryConfig
    from streamrft.kafka.serde import Serde
    from streamrft.schemas import SingleObjectCodec

    topic = f"rft.t{uuid.uuid4().hex[:10]}.tasks"
    serde = Serde(SchemaRegistryConfig(url=registry.url))
    serde.encode(Task(task_id="t0", workflow="arithmetic", payload="{}"), topic)  # the contract, registered
    evolved = json.loads(TASK_AVSC.read_text())
    evolved["fields"] = [f for f in evolved["fields"]
                         if f["name"] not in ("taskset", "reward_fn", "repeat_times", "created_at")]
    evolved["fields"].append({"name": "priority", "type": "int", "default": 0})
    client = _registry_client(registry.url)
    client.register_schema(f"{topic}-value", Schema(json.dumps(evolved), "AVRO"))  # no 409: compatible
    assert len(client.get_versions(f"{topic}-value")) == 2
    datum = {"task_id": "t9", "workflow": "arithmetic", "payload": "{}", "priority": 3}
    expected = Task(task_id="t9", workflow="arithmetic", payload="{}", created_at=0)

    confluent = AvroSerializer(client, json.dumps(evolved), conf={"auto.register.schemas": False,
                                                                  "use.latest.version": True})
    assert serde.decode(confluent(datum, SerializationContext(topic, MessageField.VALUE)), topic, Task) == expected
    single = SingleObjectCodec().encode_with(evolved, datum)
    assert Serde(SchemaRegistryConfig(url=registry.url)).decode(single, topic, Task) == expected
