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
