"""The generated encoders/decoders (schemas/compiled.py) against fastavro: the same bytes, the same records, typed
errors for every truncation and for garbage, fastavro's behaviour for values the generated code does not take."""
from __future__ import annotations

import dataclasses
import math
import struct
from io import BytesIO

import numpy as np
import pytest
from fastavro import schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from streamrft.schemas import (
    RECORD_NAMES,
    RECORD_TYPES,
    DecodeError,
    Experience,
    Metric,
    RolloutKind,
    RolloutRequest,
    SingleObjectCodec,
    Task,
    TruncatedRecordError,
    pack_f32,
    pack_i32,
    schema_json,
)
from streamrft.schemas.codec import HEADER_SIZE, _compiled
from streamrft.schemas.compiled import Unsupported, compile_record
from streamrft.schemas.contract import parsed

from .test_codec import any_record, experiences, metrics, requests, results, signals, tasks

CODEC = SingleObjectCodec()
SLOW = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                deadline=None)
# NaN payloads differ bit by bit (sign, quiet/signalling, payload); the wire must keep each one as it is.
NANS = st.sampled_from([float("nan"), -float("nan"), struct.unpack("<d", bytes.fromhex("010000000000f07f"))[0],
                        struct.unpack("<d", bytes.fromhex("ffffffffffffffff"))[0]])


def _fastavro_bytes(record) -> bytes:
    """What the generic path writes: header + fastavro's schemaless_writer over to_dict()."""
    return CODEC.encode_with(schema_json(record.schema_name), record.to_dict())


def _fastavro_record(data: bytes):
    """What the generic path reads: fastavro's schemaless_reader + from_dict()."""
    name = next(n for n in RECORD_NAMES if CODEC.fingerprint(RECORD_TYPES[n]) == data[2:HEADER_SIZE])
    datum = schemaless_reader(BytesIO(data[HEADER_SIZE:]), parsed(schema_json(name)), None)
    return RECORD_TYPES[name].from_dict(datum)


def _with_nans(record, nans: list[float]):
    """``record`` with its double fields and double map values replaced by NaNs, while any are left."""
    nans = list(nans)
    changes = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, float) and nans:
            changes[field.name] = nans.pop()
        elif field.name == "metrics" and value and nans:
            changes[field.name] = {k: nans.pop() if nans else v for k, v in value.items()}
    return dataclasses.replace(record, **changes)


@pytest.mark.parametrize("strategy", [tasks, requests, experiences, results, signals, metrics],
                         ids=lambda s: "record")
def test_generated_encoder_writes_fastavros_bytes(strategy):
    @SLOW
    @given(strategy, st.lists(NANS, max_size=3))
    def check(record, nans):
        record = _with_nans(record, nans)
        data = _compiled(record.schema_name).encode(record)
        assert data == _fastavro_bytes(record)
        assert CODEC.encode(record) == data

    check()


@SLOW
@given(any_record, st.lists(NANS, max_size=3))
def test_generated_decoder_reads_what_fastavro_reads(record, nans):
    data = _fastavro_bytes(_with_nans(record, nans))
    fast, end = _compiled(record.schema_name).decode(data, HEADER_SIZE)
    assert end == len(data)
    assert type(fast) is type(record)
    # compare as bytes: NaN != NaN, and the bytes also carry the NaN's bits
    assert _fastavro_bytes(fast) == _fastavro_bytes(_fastavro_record(data)) == data
    for field in dataclasses.fields(fast):  # enums decode to the record's enum classes, as from_dict makes them
        assert type(getattr(fast, field.name)) is type(getattr(_fastavro_record(data), field.name)), field.name


@SLOW
@given(any_record)
def test_truncation_at_every_offset_is_a_typed_error(record):
    data = CODEC.encode(record)
    assume(len(data) <= 4096)  # every offset of a 400 kB record would take minutes; see the test below
    for cut in range(len(data)):
        # under two bytes there is no magic to recognise; past it, every read beyond the end says "truncated"
        with pytest.raises(TruncatedRecordError if cut >= 2 else DecodeError):
            CODEC.decode(data[:cut])


def test_truncation_of_a_large_experience_is_a_typed_error():
    exp = Experience(eid="e" * 200, group_id="g", task_id="t", step=1, kind=RolloutKind.EVAL, run_index=0,
                     model_version=1, tokens=pack_i32(np.arange(20_000)), prompt_length=3,
                     logprobs=pack_f32(np.ones(20_000, dtype=np.float32)), reward=0.5,
                     metrics={"a": 1.0}, info={"é": "ü" * 300}, response_text="日本" * 100)
    data = CODEC.encode(exp)
    head = range(HEADER_SIZE, 400)
    tail = range(len(data) - 2000, len(data))
    for cut in [*head, *range(400, len(data) - 2000, 997), *tail]:
        with pytest.raises(TruncatedRecordError):
            CODEC.decode(data[:cut])


def _zigzag(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _string(s: str) -> bytes:
    raw = s.encode()
    return _zigzag(len(raw)) + raw


def _metric_bytes(tags_blocks: bytes, source: bytes = _string("s")) -> bytes:
    """A Metric payload written by hand, with the tags map encoded as ``tags_blocks``."""
    header = b"\xc3\x01" + CODEC.fingerprint(Metric)
    return (header + source + _string("r") + _string("n") + struct.pack("<d", 2.5) + _zigzag(7) + tags_blocks
            + _zigzag(1_700_000_000_000))


def test_maps_in_several_blocks_and_with_negative_counts_decode():
    first = _string("a") + _string("1") + _string("b") + _string("2")
    second = _string("c") + _string("3")
    # block 1: count 2; block 2: count -1 followed by its size in bytes; then the end
    blocks = _zigzag(2) + first + _zigzag(-1) + _zigzag(len(second)) + second + b"\x00"
    data = _metric_bytes(blocks)
    expected = Metric(source="s", role="r", name="n", value=2.5, step=7, tags={"a": "1", "b": "2", "c": "3"},
                      created_at=1_700_000_000_000)
    assert CODEC.decode(data, Metric) == expected
    assert _fastavro_record(data) == expected  # the hand-built bytes are valid Avro
    # a writer may also repeat a key; the last value wins, as in fastavro
    again = _zigzag(1) + _string("a") + _string("x") + b"\x00"
    assert CODEC.decode(_metric_bytes(_zigzag(1) + _string("a") + _string("1") + again), Metric).tags == {"a": "x"}


def test_experience_maps_in_blocks_decode():
    exp = Experience(eid="e", group_id="g", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0,
                     model_version=0, tokens=b"", prompt_length=0, logprobs=b"", reward=0.0,
                     metrics={"x": 1.0, "y": -2.0}, created_at=5)
    one_block = CODEC.encode(exp)
    entries = [_string("x") + struct.pack("<d", 1.0), _string("y") + struct.pack("<d", -2.0)]
    blocks = (_zigzag(-1) + _zigzag(len(entries[0])) + entries[0] + _zigzag(1) + entries[1] + b"\x00")
    one = _zigzag(2) + entries[0] + entries[1] + b"\x00"
    assert one in one_block
    assert CODEC.decode(one_block.replace(one, blocks), Experience) == exp


@pytest.mark.parametrize("payload, message", [
    (_metric_bytes(b"\x00", source=b"\x03"), "negative length"),
    (_metric_bytes(b"\x00", source=b"\x04\xff\xfe"), "UnicodeDecodeError"),
    (_metric_bytes(b"\x00", source=b"\x81\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"), "longer than 10 bytes"),
    (_metric_bytes(b"\x00") + b"\x00", "trailing"),
])
def test_garbage_is_a_decode_error_not_a_truncation(payload, message):
    with pytest.raises(DecodeError, match=message) as caught:
        CODEC.decode(payload)
    assert not isinstance(caught.value, TruncatedRecordError)


def test_bad_enum_union_and_boolean_bytes_are_decode_errors():
    request = RolloutRequest(request_id="r", step=0, kind=RolloutKind.EVAL, task=Task("t", "w", "{}"),
                             repeat_times=1, created_at=1)
    data = CODEC.encode(request)
    kind_at = HEADER_SIZE + 2 + 1  # after request_id ("r") and step (0)
    assert data[kind_at] == 2  # EVAL
    for bad, message in ((4, "enum index 2"), (1, "enum index -1"), (0x84, "enum index 2")):
        payload = data[:kind_at] + bytes([bad]) + (b"\x00" if bad & 0x80 else b"") + data[kind_at + 1:]
        with pytest.raises(DecodeError, match=message) as caught:
            CODEC.decode(payload)
        assert not isinstance(caught.value, TruncatedRecordError)
    # the body ends: repeat_times 1, min_model_version 0, deadline_ms null (union index 0), created_at 1
    assert data[-4:] == b"\x02\x00\x00\x02"
    with pytest.raises(DecodeError, match="deadline_ms: union index"):
        CODEC.decode(data[:-2] + b"\x04" + data[-1:])
    exp = CODEC.encode(Experience(eid="", group_id="", task_id="", step=0, kind=RolloutKind.TRAIN, run_index=0,
                                  model_version=0, tokens=b"", prompt_length=0, logprobs=b"", reward=0.0,
                                  truncated=True, created_at=0))
    truncated_at = exp.index(b"\x01", HEADER_SIZE + 3 + 6 + 8)  # after the strings, ints, bytes, nulls and reward
    with pytest.raises(DecodeError, match="truncated: boolean"):
        CODEC.decode(exp[:truncated_at] + b"\x02" + exp[truncated_at + 1:])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(RECORD_NAMES), st.binary(max_size=80))
def test_random_bodies_decode_to_what_fastavro_reads_or_fail_typed(name, body):
    data = b"\xc3\x01" + CODEC.fingerprint(RECORD_TYPES[name]) + body
    try:
        record = CODEC.decode(data)
    except DecodeError:
        return
    assert _fastavro_bytes(record) == _fastavro_bytes(_fastavro_record(data))


def test_values_the_generated_encoder_refuses_go_to_fastavro():
    base = dict(eid="e", group_id="g", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0,
                model_version=0, tokens=b"\x01\x00\x00\x00", prompt_length=0, logprobs=b"", reward=0.0,
                created_at=1)
    # numpy scalars, a bytearray, a plain string for an enum: fastavro writes them; so must the codec, identically
    odd = Experience(**{**base, "step": np.int64(2**40), "run_index": np.int32(3), "reward": np.float32(0.5),
                        "tokens": bytearray(b"\x01\x00\x00\x00"), "kind": "EVAL", "created_at": np.int64(5)})
    assert CODEC.encode(odd) == _fastavro_bytes(odd)
    # wrong types are fastavro's errors, naming the field
    with pytest.raises(TypeError, match="tokens"):
        CODEC.encode(Experience(**{**base, "tokens": "not bytes"}))
    with pytest.raises(TypeError, match="string"):
        CODEC.encode(Experience(**{**base, "eid": 5}))
    with pytest.raises(ValueError, match="not in list"):
        CODEC.encode(Experience(**{**base, "kind": "TEST"}))
    with pytest.raises(OverflowError):
        CODEC.encode(Experience(**{**base, "step": 2**63}))
    with pytest.raises(ValueError, match="repeat_times"):  # a union's int must fit 32 bits and not be a bool
        CODEC.encode(Task(task_id="t", workflow="w", payload="{}", repeat_times=2**31))
    with pytest.raises(ValueError, match="repeat_times"):
        CODEC.encode(Task(task_id="t", workflow="w", payload="{}", repeat_times=True))


def test_schemas_it_does_not_generate_for_are_refused_at_compile_time():
    @dataclasses.dataclass
    class Holder:
        f: object

    for field_type in ({"type": "array", "items": "long"}, ["string", "long"], ["null", "double"],
                       {"type": "fixed", "name": "F", "size": 4}):
        schema = {"type": "record", "name": "Holder", "fields": [{"name": "f", "type": field_type}]}
        with pytest.raises(Unsupported):
            compile_record(schema, {"Holder": Holder})
    schema = {"type": "record", "name": "Holder", "fields": [{"name": "g", "type": "long"}]}
    with pytest.raises(Unsupported, match="fields differ"):
        compile_record(schema, {"Holder": Holder})


def test_every_contract_schema_is_generated():
    for name in RECORD_NAMES:
        assert _compiled(name) is not None, name
        assert "def encode" in _compiled(name).source
    # the generated encoder really is what encode() uses: it writes the same bytes as fastavro
    buf = BytesIO()
    schemaless_writer(buf, parsed(schema_json("Task")), Task("t", "w", "{}", created_at=1).to_dict())
    assert CODEC.encode(Task("t", "w", "{}", created_at=1))[HEADER_SIZE:] == buf.getvalue()
