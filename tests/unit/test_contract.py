"""The contract as a writer in another language sees it: `streamrft schemas` (self-contained schemas, canonical
forms, fingerprints, the single-object header) checked against Apache Avro's Java answers (shipped as vectors,
tests/unit/avro_java_vectors.json, made by tests/integration/avro_java/reference.py; the integration test
test_avro_java.py asks Java again), and the dead letter of a fingerprint computed over another form."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from fastavro import schemaless_writer
from fastavro.schema import parse_schema

from streamrft.cli import main
from streamrft.schemas import (RECORD_NAMES, RECORD_TYPES, SingleObjectCodec, Task, UnknownFingerprintError,
                               canonical_form, schema_json)
from streamrft.schemas.canonical_rules import (FULL_NAMES, LOGICAL_TYPE, PRIMITIVE_OBJECT, canonical, crc64_avro)
from streamrft.schemas.contract import parsed, previous_schemas
from streamrft.schemas.published import contract

VECTORS = json.loads((Path(__file__).with_name("avro_java_vectors.json")).read_text())["records"]
CODEC = SingleObjectCodec()


def test_the_vectors_cover_every_record_type():
    assert sorted(VECTORS) == sorted(RECORD_NAMES)


@pytest.mark.parametrize("name", RECORD_NAMES)
def test_form_fingerprint_and_header_are_javas(name):
    """Java's parsingFingerprint64 printed as a number is fingerprint_hex; its BinaryMessageEncoder's first 10
    bytes are header_hex (so the wire order is little-endian, as Java writes it)."""
    ours, java = contract()[name], VECTORS[name]
    assert ours["canonical_form"] == java["canonical_form"]
    assert ours["fingerprint_hex"] == java["fingerprint_hex"]
    assert ours["header_hex"] == java["encoded_hex"][:20]
    assert ours["header_hex"] == "c301" + bytes.fromhex(ours["fingerprint_hex"])[::-1].hex()
    assert ours["fingerprint_int64"] == int.from_bytes(bytes.fromhex(ours["fingerprint_hex"]), "big", signed=True)


@pytest.mark.parametrize("name", RECORD_NAMES)
def test_a_record_java_encoded_decodes(name):
    """Java's single-object encoding of a record (defaults, else each type's first value) is read by the codec."""
    record = CODEC.decode(bytes.fromhex(VECTORS[name]["encoded_hex"]), RECORD_TYPES[name])
    assert type(record) is RECORD_TYPES[name]
    assert record.created_at == 0  # created_at's default


def test_schemas_json_has_the_published_shape(capsys):
    assert main(["schemas", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == list(RECORD_NAMES)
    for name, entry in printed.items():
        assert {"schema", "canonical_form", "fingerprint_hex", "header_hex"} <= set(entry)
        assert len(entry["fingerprint_hex"]) == 16 and entry["header_hex"].startswith("c301")
        # self-contained: it parses alone, with no named type of another file supplied
        parse_schema(entry["schema"], named_schemas={})
        assert canonical_form(entry["schema"]) == entry["canonical_form"]


def test_schemas_text_names_the_byte_order_and_refuses_an_unknown_record(capsys):
    assert main(["schemas", "Task"]) == 0
    out = capsys.readouterr().out
    assert "== Task" in out and "c3 01 76 24 c6 a3 3d 4d 41 0b" in out and "little-endian" in out
    assert "== Metric" not in out
    assert main(["schemas", "Tsk"]) == 2
    assert "unknown record type Tsk" in capsys.readouterr().err


def test_the_rules_writer_gives_the_spec_form_of_every_schema():
    for name, schema in [(n, schema_json(n)) for n in RECORD_NAMES] + previous_schemas():
        assert canonical(schema) == canonical_form(schema), name


def _payload(skipped) -> bytes:
    """A Task written by a library that computes its fingerprint without the steps ``skipped``."""
    schema = schema_json("Task")
    body = io.BytesIO()
    schemaless_writer(body, parsed(schema), Task(task_id="t", workflow="arithmetic", payload="{}").to_dict())
    return b"\xc3\x01" + crc64_avro(canonical(schema, frozenset(skipped))) + body.getvalue()


@pytest.mark.parametrize("skipped, says, library", [
    ({LOGICAL_TYPE}, "drops logicalType", "hamba/avro"),
    ({PRIMITIVE_OBJECT}, 'writes a primitive by its bare name ({"type":"long"} becomes "long")', "goavro"),
    ({FULL_NAMES}, "full name", None),
])
def test_a_fingerprint_over_another_form_says_which_step_was_skipped(skipped, says, library):
    with pytest.raises(UnknownFingerprintError) as refused:
        CODEC.decode(_payload(skipped), Task)
    message = str(refused.value)
    assert refused.value.reason == "unknown-fingerprint"
    assert "the Task schema's fingerprint" in message and says in message
    assert CODEC.fingerprint(Task).hex() in message  # the right one, in wire order
    assert (library in message) if library else ("hamba" not in message and "goavro" not in message)


def test_an_unknown_fingerprint_lists_the_steps_and_the_ways_on():
    with pytest.raises(UnknownFingerprintError) as refused:
        CODEC.decode(b"\xc3\x01" + bytes(range(8)) + b"\x00", Task)
    message = str(refused.value)
    assert "drops logicalType" in message and '{"type":"long"} as "long"' in message
    assert "hamba/avro and goavro" in message and "streamrft schemas" in message
    assert "schema registry" in message


def test_a_writer_without_created_at_is_read_with_its_default():
    """created_at has a default: a foreign writer's schema may leave it out (and resolves against ours)."""
    writer = json.loads(json.dumps(schema_json("Task")))
    writer["fields"] = [f for f in writer["fields"] if f["name"] != "created_at"]
    codec = SingleObjectCodec()
    codec.register_writer_schema("Task", writer)
    task = codec.decode(codec.encode_with(writer, {"task_id": "t", "taskset": "x", "workflow": "arithmetic",
                                                   "payload": "{}", "reward_fn": None, "repeat_times": None}), Task)
    assert task.created_at == 0 and task.taskset == "x"


def test_a_fingerprint_written_big_endian_is_named_as_such():
    data = _payload(())
    with pytest.raises(UnknownFingerprintError) as refused:
        CODEC.decode(data[:2] + data[2:10][::-1] + data[10:], Task)
    assert "Task schema's fingerprint in the wrong byte order" in str(refused.value)
    assert "little-endian" in str(refused.value)
