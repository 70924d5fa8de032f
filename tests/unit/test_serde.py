"""Serde: single-object by default; Confluent wire format through confluent_kafka's schema-registry client
when a registry is configured (``mock://`` is the library's in-process registry); decoding accepts both."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from streamrft.config import SchemaRegistryConfig
from streamrft.kafka.serde import RegistryNotConfiguredError, Serde
from streamrft.schemas import Experience, RolloutKind, Task, pack_f32, pack_i32


def _experience() -> Experience:
    return Experience(eid="e/0", group_id="g", task_id="t", step=3, kind=RolloutKind.TRAIN, run_index=0,
                      model_version=2, tokens=pack_i32(np.arange(10)), prompt_length=4,
                      logprobs=pack_f32(np.full(6, -0.5)), reward=1.0, metrics={"len": 6.0}, created_at=1_800_000_000_123)


def test_default_is_single_object():
    serde = Serde()
    data = serde.encode(_experience(), "rft.x.experiences")
    assert data[:2] == b"\xc3\x01"
    assert serde.decode(data, "rft.x.experiences", Experience) == _experience()


def test_confluent_wire_format_with_a_registry_and_both_framings_decode():
    registry = SchemaRegistryConfig(url=f"mock://{uuid.uuid4().hex}")
    serde = Serde(registry)
    topic = "rft.x.experiences"
    confluent = serde.encode(_experience(), topic)
    assert confluent[0] == 0 and len(confluent) > 5  # magic byte + 4-byte schema id
    assert serde.decode(confluent, topic, Experience) == _experience()
    single = Serde().encode(_experience(), topic)
    assert serde.decode(single, topic, Experience) == _experience()  # a registry reader still reads C3 01


def test_confluent_framed_record_without_a_registry_is_a_clear_error():
    registry = SchemaRegistryConfig(url=f"mock://{uuid.uuid4().hex}")
    data = Serde(registry).encode(Task(task_id="t", workflow="w", payload="{}"), "rft.x.tasks")
    with pytest.raises(RegistryNotConfiguredError, match="schema_registry.url"):
        Serde().decode(data, "rft.x.tasks", Task)


# -- writer schemas other than the contract's ---------------------------------------------------------------------
def _evolved_task_schema() -> dict:
    """Task as a foreign producer evolved it: a field added with a default, and without the fields the reader has
    defaults for (taskset, reward_fn, repeat_times, created_at)."""
    import json

    from streamrft.schemas import schema_json

    schema = json.loads(json.dumps(schema_json("Task")))
    schema["fields"] = [f for f in schema["fields"]
                        if f["name"] not in ("taskset", "reward_fn", "repeat_times", "created_at")]
    schema["fields"].append({"name": "priority", "type": "int", "default": 0})
    return schema


EVOLVED = {"task_id": "t9", "workflow": "arithmetic", "payload": "{}", "priority": 3}


def test_a_confluent_framed_evolved_writer_resolves_against_the_reader():
    import json

    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    serde = Serde(SchemaRegistryConfig(url=f"mock://{uuid.uuid4().hex}"))
    topic = "rft.x.tasks"
    # the mock registry lives in its client: the foreign writer shares the reader's
    writer = AvroSerializer(serde._registry_client(), json.dumps(_evolved_task_schema()))
    data = writer(EVOLVED, SerializationContext(topic, MessageField.VALUE))
    assert data[0] == 0
    task = serde.decode(data, topic, Task)
    assert task == Task(task_id="t9", workflow="arithmetic", payload="{}", taskset="default", reward_fn=None,
                        repeat_times=None, created_at=0)


def test_a_single_object_evolved_writer_is_read_through_the_subject_and_refused_without_a_registry():
    """With a registry, a single-object record's unknown fingerprint is looked up among the schemas registered
    under the topic's subject; without one it is an unknown fingerprint, and the reason says so."""
    import json

    from confluent_kafka.schema_registry import Schema

    from streamrft.schemas import SingleObjectCodec, UnknownFingerprintError

    registry = SchemaRegistryConfig(url=f"mock://{uuid.uuid4().hex}")
    topic = "rft.x.tasks"
    schema = _evolved_task_schema()
    data = SingleObjectCodec().encode_with(schema, EVOLVED)
    with pytest.raises(UnknownFingerprintError, match="schema registry"):
        Serde().decode(data, topic, Task)
    serde = Serde(registry)
    with pytest.raises(UnknownFingerprintError):  # not registered yet
        serde.decode(data, topic, Task)
    serde._registry_client().register_schema(f"{topic}-value", Schema(json.dumps(schema), "AVRO"))
    serde._listed_at.clear()  # the next lookup would wait LOOKUP_INTERVAL_S
    assert serde.decode(data, topic, Task) == Task(task_id="t9", workflow="arithmetic", payload="{}", created_at=0)


def test_unknown_fingerprints_list_a_subject_at_most_once_per_interval():
    from streamrft.schemas import UnknownFingerprintError

    calls = []

    class Counting:
        def get_versions(self, subject):
            calls.append(subject)
            return []

    serde = Serde(SchemaRegistryConfig(url=f"mock://{uuid.uuid4().hex}"))
    serde._client = Counting()
    for i in range(50):
        with pytest.raises(UnknownFingerprintError):
            serde.decode(b"\xc3\x01" + i.to_bytes(8, "little") + b"\x00", "rft.x.tasks", Task)
    assert calls == ["rft.x.tasks-value"]
