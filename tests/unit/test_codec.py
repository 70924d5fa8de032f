"""The Avro contract and the single-object codec: round trips, framing, fingerprints, evolution, bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrft.schemas import (
    RECORD_NAMES,
    DecodeError,
    Experience,
    Metric,
    RolloutKind,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
    SingleObjectCodec,
    SyncKind,
    SyncMethod,
    SyncSignal,
    Task,
    TruncatedRecordError,
    UnknownFingerprintError,
    UnknownMagicError,
    WrongRecordTypeError,
    canonical_form,
    fingerprint64,
    framing_of,
    pack_f32,
    pack_i32,
    pack_u8,
    schema_json,
    unpack_f32,
    unpack_i32,
)

CODEC = SingleObjectCodec()

text = st.text(max_size=40)  # hypothesis text covers the whole of unicode, surrogates excluded
long = st.integers(min_value=-(2**63), max_value=2**63 - 1)
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
millis = st.integers(min_value=0, max_value=4_102_444_800_000)  # up to 2100
# Avro doubles carry every IEEE value; NaN is checked separately because NaN != NaN.
double = st.floats(allow_nan=False, allow_infinity=True) | st.sampled_from([5e-324, 1.7976931348623157e308, -0.0])
arrays_i32 = st.one_of(
    st.lists(int32, max_size=64).map(pack_i32),
    st.sampled_from([b"", pack_i32(np.arange(100_000, dtype=np.int32))]),
)
arrays_f32 = st.one_of(
    st.lists(st.floats(width=32, allow_nan=False), max_size=64).map(pack_f32),
    st.sampled_from([b"", pack_f32(np.linspace(-1e30, 1e30, 100_000, dtype=np.float32))]),
)

tasks = st.builds(Task, task_id=text, workflow=text, payload=text, taskset=text,
                  reward_fn=st.none() | text, repeat_times=st.none() | int32, created_at=millis)
requests = st.builds(RolloutRequest, request_id=text, step=long, kind=st.sampled_from(RolloutKind), task=tasks,
                     repeat_times=int32, min_model_version=long, deadline_ms=st.none() | millis, created_at=millis)
experiences = st.builds(
    Experience, eid=text, group_id=text, task_id=text, step=long, kind=st.sampled_from(RolloutKind),
    run_index=int32, model_version=long, tokens=arrays_i32, prompt_length=int32, logprobs=arrays_f32,
    reward=double, group_size=int32, action_mask=st.none() | st.lists(st.integers(0, 1), max_size=64).map(pack_u8),
    token_rewards=st.none() | arrays_f32, truncated=st.booleans(), prompt_text=text, response_text=text,
    metrics=st.dictionaries(text, double, max_size=4), info=st.dictionaries(text, text, max_size=4),
    worker_id=text, created_at=millis,
)
results = st.builds(
    RolloutResult, request_id=text, step=long, task_id=text, status=st.sampled_from(RolloutStatus), n=int32,
    model_version=long, duration_ms=long, kind=st.sampled_from(RolloutKind), reward_mean=double,
    reward_std=double, reward_min=double, reward_max=double, accuracy=double, response_length_mean=double,
    error=st.none() | text, worker_id=text, created_at=millis,
)
signals = st.builds(SyncSignal, kind=st.sampled_from(SyncKind), version=long, trainer_step=long,
                    method=st.sampled_from(SyncMethod), uri=text, sha256=text, nbytes=long, source=text, state=text,
                    created_at=millis, lineage=text)
metrics = st.builds(Metric, source=text, role=text, name=text, value=double, step=long,
                    tags=st.dictionaries(text, text, max_size=4), created_at=millis)
any_record = st.one_of(tasks, requests, experiences, results, signals, metrics)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(any_record)
def test_every_record_round_trips(record):
    data = CODEC.encode(record)
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == CODEC.fingerprint(type(record))
    assert CODEC.decode(data, type(record)) == record


def test_nan_round_trips():
    metric = Metric(source="s", role="r", name="n", value=float("nan"), step=0)
    assert np.isnan(CODEC.decode(CODEC.encode(metric), Metric).value)


def test_packed_arrays_round_trip_through_numpy():
    tokens = np.arange(-5, 100_000, dtype=np.int32)
    logprobs = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    exp = Experience(eid="e", group_id="g", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0,
                     model_version=0, tokens=pack_i32(tokens), prompt_length=5, logprobs=pack_f32(logprobs),
                     reward=0.5)
    back = CODEC.decode(CODEC.encode(exp), Experience)
    np.testing.assert_array_equal(back.token_array, tokens)
    np.testing.assert_array_equal(back.logprob_array, logprobs)
    assert back.response_length == len(tokens) - 5
    assert back.action_mask_array.tolist() == [1] * back.response_length


def _spec_crc64_avro(data: bytes) -> bytes:
    """The Rabin fingerprint exactly as the Avro specification describes it, written out independently of
    fastavro, little-endian as single-object encoding puts it on the wire."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp.to_bytes(8, "little")


def test_fingerprint_matches_the_avro_spec():
    # The spec's published value for the schema "int".
    assert fingerprint64("int").hex() == "8f5c393f1ad57572"
    assert _spec_crc64_avro(b'"int"').hex() == "8f5c393f1ad57572"
    for name in RECORD_NAMES:
        canonical = canonical_form(schema_json(name)).encode()
        assert fingerprint64(schema_json(name)) == _spec_crc64_avro(canonical), name


def test_fingerprints_are_distinct_and_stable_per_record():
    fps = {name: fingerprint64(schema_json(name)) for name in RECORD_NAMES}
    assert len(set(fps.values())) == len(fps)
    assert fingerprint64(schema_json("Task")) == fps["Task"]


def test_framing_detection():
    assert framing_of(b"\xc3\x01" + b"\0" * 8) == "single-object"
    assert framing_of(b"\x00\x00\x00\x00\x01\x02") == "confluent"
    with pytest.raises(UnknownMagicError, match="ffff"):
        framing_of(b"\xff\xff\x01")
    with pytest.raises(UnknownMagicError, match="empty"):
        framing_of(b"")


def test_unknown_fingerprint_names_it():
    data = b"\xc3\x01" + bytes.fromhex("0102030405060708") + b"\x00"
    with pytest.raises(UnknownFingerprintError, match="0102030405060708"):
        CODEC.decode(data)


def test_truncated_records_are_typed_errors():
    task = Task(task_id="t" * 50, workflow="arithmetic", payload='{"question": "1+1"}')
    data = CODEC.encode(task)
    with pytest.raises(TruncatedRecordError):
        CODEC.decode(data[:6])
    for cut in (11, len(data) // 2, len(data) - 1):
        with pytest.raises(DecodeError):
            CODEC.decode(data[:cut])


def test_wrong_record_type_is_refused():
    data = CODEC.encode(Metric(source="s", role="r", name="n", value=1.0, step=0))
    with pytest.raises(WrongRecordTypeError, match="Metric"):
        CODEC.decode(data, Task)


def test_trailing_bytes_are_refused():
    data = CODEC.encode(Metric(source="s", role="r", name="n", value=1.0, step=0))
    with pytest.raises(DecodeError, match="trailing"):
        CODEC.decode(data + b"\x00\x00")


def test_record_written_by_an_older_schema_decodes_with_defaults():
    """BACKWARD compatibility: a Task v0 without reward_fn / repeat_times / taskset (fields that were added
    later with defaults) is read by today's reader."""
    older = json.loads(json.dumps(schema_json("Task")))
    older["fields"] = [f for f in older["fields"] if f["name"] not in ("reward_fn", "repeat_times", "taskset")]
    codec = SingleObjectCodec()
    codec.register_writer_schema("Task", older)
    data = codec.encode_with(older, {"task_id": "t1", "workflow": "arithmetic", "payload": "{}",
                                     "created_at": 1_700_000_000_000})
    assert data[2:10] != codec.fingerprint(Task)
    task = codec.decode(data, Task)
    assert task == Task(task_id="t1", workflow="arithmetic", payload="{}", taskset="default", reward_fn=None,
                        repeat_times=None, created_at=1_700_000_000_000)
    # An unregistered codec has never seen that writer, and says so.
    with pytest.raises(UnknownFingerprintError):
        SingleObjectCodec().decode(data)


def test_every_added_field_has_a_default():
    """Fields beyond each record's required core must carry defaults, or old writers break new readers.
    ``created_at`` has one (0: the writer did not say), so a foreign writer may leave it out."""
    required = {
        "Task": {"task_id", "workflow", "payload"},
        "RolloutRequest": {"request_id", "step", "kind", "task", "repeat_times"},
        "Experience": {"eid", "group_id", "task_id", "step", "kind", "run_index", "model_version", "tokens",
                       "prompt_length", "logprobs", "reward"},
        "RolloutResult": {"request_id", "step", "task_id", "status", "n", "model_version", "duration_ms"},
        "SyncSignal": {"kind", "version"},
        "Metric": {"source", "role", "name", "value", "step"},
        "FeedbackReceipt": {"response_id", "choice", "reward", "eid", "group_id", "group_size", "run_index",
                            "model_version"},
    }
    for name in RECORD_NAMES:
        without_default = {f["name"] for f in schema_json(name)["fields"] if "default" not in f}
        assert without_default == required[name], name


def test_unpack_rejects_ragged_buffers():
    with pytest.raises(ValueError, match="whole number"):
        unpack_i32(b"\x00\x01\x02")
    assert unpack_f32(None).size == 0


def test_records_of_earlier_schema_versions_still_decode():
    """A SyncSignal written before ``lineage`` existed (the schema in schemas/previous/) decodes, with the
    field's default: a sync topic from an older release does not stop the roles of a newer one."""
    import io
    import json

    from fastavro import schemaless_writer

    from streamrft.schemas.contract import PREVIOUS_DIR, fingerprint64, parsed

    old = json.loads((PREVIOUS_DIR / "SyncSignal.1.avsc").read_text())
    assert "lineage" not in {f["name"] for f in old["fields"]}
    body = io.BytesIO()
    schemaless_writer(body, parsed(old), {"kind": "WEIGHTS_PUBLISHED", "version": 4, "trainer_step": 4,
                                          "method": "OBJECT_STORE", "uri": "file:///w", "sha256": "ab", "nbytes": 1,
                                          "source": "trainer", "state": "", "created_at": 1})
    payload = b"\xc3\x01" + fingerprint64(old) + body.getvalue()
    signal = SingleObjectCodec().decode(payload, SyncSignal)
    assert signal.version == 4 and signal.lineage == ""


def test_a_record_written_with_batch_id_decodes_into_step():
    """``batch_id`` was renamed ``step`` (it always was the explorer step); the field carries the old name as an
    alias, so records written by an older release decode with their step intact."""
    import io

    from fastavro import schemaless_writer

    from streamrft.schemas.contract import fingerprint64, parsed, previous_schemas

    old = next(schema for name, schema in previous_schemas()  # the first version, before the rename
               if name == "RolloutResult" and "batch_id" in {f["name"] for f in schema["fields"]})
    body = io.BytesIO()
    schemaless_writer(body, parsed(old), {"request_id": "r", "batch_id": 12, "task_id": "t", "status": "OK", "n": 2,
                                          "model_version": 3, "duration_ms": 5, "created_at": 1})
    result = SingleObjectCodec().decode(b"\xc3\x01" + fingerprint64(old) + body.getvalue(), RolloutResult)
    assert result.step == 12 and result.request_id == "r"
