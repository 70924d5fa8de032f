"""The state of the trainer's collective signals has one writer and one parser (engines.weights.signal_state):
what the trainer writes parses back, each malformed field is refused naming it, and the check where roles read
``sync`` (streamrft.validation) refuses the same records with the parser's words. No broker, no torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from streamrft.engines.weights.signal_state import Announcement, DeliveryState
from streamrft.schemas import InvalidRecordError, SyncKind, SyncMethod, SyncSignal
from streamrft.validation import check_sync

ANNOUNCED = Announcement(session="ab12cd34ef56", receivers=2, bucket_bytes=1 << 20, backend="gloo")
DELIVERED = DeliveryState(epoch=3, receivers=("w0/1a2b", "w1/3c4d"), catch_up="", digest="0f" * 32)
_MISSING = object()


def ready(state: str) -> SyncSignal:
    return SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE, uri="tcp://127.0.0.1:29501",
                      state=state, lineage="a")


def published(state: str) -> SyncSignal:
    return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=4, method=SyncMethod.COLLECTIVE,
                      uri="tcp://127.0.0.1:29501", state=state, lineage="a")


def with_field(written: str, name: str, value) -> str:
    doc = json.loads(written)
    if value is _MISSING:
        del doc[name]
    else:
        doc[name] = value
    return json.dumps(doc)



def test_what_the_writer_writes_the_parser_reads_back():
    assert Announcement.parse(ANNOUNCED.to_json()) == ANNOUNCED
    assert DeliveryState.parse(DELIVERED.to_json()) == DELIVERED
    caught_up = DeliveryState(1, (), "file:///w/v00000004-a/manifest.json")
    assert DeliveryState.parse(caught_up.to_json()) == caught_up
    assert DeliveryState.parse("") == DeliveryState(0, (), "")  # delivered to nobody, no copy
    check_sync(ready(ANNOUNCED.to_json()), weights_method="collective")
    check_sync(published(DELIVERED.to_json()), weights_method="collective")


@pytest.mark.parametrize("name, value", [
    ("session", _MISSING), ("session", ""), ("session", "x; rm"), ("session", "a" * 65), ("session", 12),
    ("receivers", _MISSING), ("receivers", "2"), ("receivers", True), ("receivers", -1), ("receivers", 65537),
    ("bucket_bytes", 0), ("bucket_bytes", True), ("bucket_bytes", "1"),
    ("backend", _MISSING), ("backend", "mpi"),
])
def test_each_malformed_announcement_field_is_refused_by_name_and_validation_agrees(name, value):
    state = with_field(ANNOUNCED.to_json(), name, value)
    with pytest.raises(ValueError, match=name) as parsed:
        Announcement.parse(state)
    with pytest.raises(InvalidRecordError) as checked:
        check_sync(ready(state), weights_method="collective")
    assert checked.value.reason == "bad-announcement" and str(parsed.value) in str(checked.value)


@pytest.mark.parametrize("name, value", [
    ("epoch", -1), ("epoch", True), ("epoch", "1"), ("receivers", "w0/1a2b"), ("receivers", [1]),
    ("catch_up", 3), ("digest", 7), ("digest", "0F" * 32), ("digest", "0f" * 31), ("digest", "xy" * 32),
])
def test_each_malformed_delivery_field_is_refused_by_name_and_validation_agrees(name, value):
    state = with_field(DELIVERED.to_json(), name, value)
    with pytest.raises(ValueError, match=name) as parsed:
        DeliveryState.parse(state)
    with pytest.raises(InvalidRecordError) as checked:
        check_sync(published(state), weights_method="collective")
    assert checked.value.reason == "bad-state" and str(parsed.value) in str(checked.value)


@pytest.mark.parametrize("state", ["{x", "[1, 2]", "[" * 100_000])
def test_a_state_that_is_no_json_object_is_refused_by_both(state):
    for parse, signal, reason in ((Announcement.parse, ready, "bad-announcement"),
                                  (DeliveryState.parse, published, "bad-state")):
        with pytest.raises(ValueError, match="JSON"):
            parse(state)
        with pytest.raises(InvalidRecordError) as checked:
            check_sync(signal(state), weights_method="collective")
        assert checked.value.reason == reason


def test_checking_sync_records_loads_no_torch():
    code = ("import sys, streamrft.validation, streamrft.engines.weights; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
