"""The record checks applied where roles read (streamrft.validation), the explorer state's tolerant parsing,
the trainer-lineage rule for weights, and the dead-letter ledger. No broker."""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from streamrft.kafka.dlq import DeadLetterLedger, dead_letter
from streamrft.schemas import (Experience, InvalidRecordError, Metric, RolloutKind, RolloutRequest, RolloutResult,
                               RolloutStatus, SyncKind, SyncMethod, SyncSignal, Task, pack_f32, pack_i32, pack_u8)
from streamrft.sync import supersedes
from streamrft.explorer_state import ExplorerState
from streamrft.validation import (check_experience, check_metric, check_request, check_result,
                                  check_control, check_sync, check_task)


def experience(**changes) -> Experience:
    fields = dict(eid="g/0", group_id="g", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0,
                  model_version=0, tokens=pack_i32([1, 2, 3, 4, 5]), prompt_length=2,
                  logprobs=pack_f32([-0.5, -1.0, -2.0]), reward=1.0)
    return Experience(**{**fields, **changes})


def reason_of(check, record, **kwargs) -> str:
    with pytest.raises(InvalidRecordError) as info:
        check(record, **kwargs)
    assert str(info.value)  # a sentence saying what is wrong
    return info.value.reason


def test_a_good_experience_passes():
    check_experience(experience(), vocab_size=10, max_tokens=5)
    check_experience(experience(action_mask=pack_u8([1, 0, 1]), token_rewards=pack_f32([0, 0, 1])))


@pytest.mark.parametrize("changes, reason", [
    ({"tokens": b"\x01\x02\x03"}, "experience-lengths"),
    ({"prompt_length": 5}, "experience-lengths"),
    ({"prompt_length": 0}, "experience-lengths"),
    ({"logprobs": pack_f32([-1.0])}, "experience-lengths"),
    ({"action_mask": pack_u8([1, 1])}, "experience-lengths"),
    ({"token_rewards": pack_f32([1.0])}, "experience-lengths"),
    ({"reward": float("nan")}, "non-finite"),
    ({"reward": float("inf")}, "non-finite"),
    ({"tokens": pack_i32([1, 2, 3, 4, 99])}, "token-out-of-vocab"),
    ({"tokens": pack_i32([1, 2, 3, 4, -1])}, "token-out-of-vocab"),
    ({"logprobs": pack_f32([-0.5, float("nan"), -2.0])}, "bad-logprobs"),
    ({"logprobs": pack_f32([-0.5, 3.0, -2.0])}, "bad-logprobs"),
    ({"model_version": -1}, "out-of-range"),
    ({"eid": ""}, "missing-id"),
])
def test_impossible_experiences_are_refused_with_a_reason(changes, reason):
    assert reason_of(check_experience, experience(**changes), vocab_size=10) == reason


def test_an_experience_longer_than_the_model_is_oversized():
    assert reason_of(check_experience, experience(), max_tokens=4) == "oversized"


@pytest.mark.parametrize("task, reason", [
    (Task(task_id="", workflow="w", payload="{}"), "missing-id"),
    (Task(task_id="x" * 600, workflow="w", payload="{}"), "id-too-long"),
    (Task(task_id="t", workflow="", payload="{}"), "missing-workflow"),
    (Task(task_id="t", workflow="w", payload="{nope"), "bad-payload"),
    (Task(task_id="t", workflow="w", payload="[1, 2]"), "bad-payload"),
    (Task(task_id="t", workflow="w", payload="{}", repeat_times=0), "out-of-range"),
    (Task(task_id="t", workflow="w", payload=json.dumps({"q": "x" * 5000})), "oversized"),
])
def test_bad_tasks_are_refused(task, reason):
    assert reason_of(check_task, task, max_bytes=4096) == reason


def test_requests_results_and_metrics():
    good = Task(task_id="t", workflow="w", payload="{}")
    check_request(RolloutRequest(request_id="r", step=0, kind=RolloutKind.TRAIN, task=good, repeat_times=2))
    bad = RolloutRequest(request_id="r", step=-1, kind=RolloutKind.TRAIN, task=good, repeat_times=2)
    assert reason_of(check_request, bad) == "out-of-range"
    result = RolloutResult(request_id="r", step=0, task_id="t", status=RolloutStatus.OK, n=1, model_version=0,
                           duration_ms=1)
    check_result(result)
    result.accuracy = float("nan")
    assert reason_of(check_result, result) == "non-finite"
    check_metric(Metric(source="s", role="r", name="rollout/reward_mean", value=float("nan"), step=0))
    assert reason_of(check_metric, Metric(source="s", role="r", name="m", value=float("-inf"), step=0)) == \
        "non-finite"
    assert reason_of(check_metric, Metric(source="s", role="r", name="", value=1.0, step=0)) == "bad-metric-name"


def test_explorer_state_ignores_unknown_keys_and_refuses_bad_shapes():
    state = ExplorerState(next_step=3, epoch=1, finished_step=2,
                          tasksets={"tasks": {"epoch": 1, "pending": [[1, 0, 17]], "blocks": 2},
                                    "math": {"epoch": 0, "taken": "AQ=="}})
    data = json.loads(state.to_json()) | {"added_by_a_newer_explorer": {"x": 1}}
    assert ExplorerState.from_json(json.dumps(data)) == state
    assert ExplorerState.from_json("") == ExplorerState()
    # an explorer of one taskset, before tasksets: its pending tasks are the tasks topic's
    older = ExplorerState.from_json('{"next_step": 3, "epoch": 1, "pending": [[1, 0, 17]], "finished_step": 2}')
    assert older.tasksets == {"tasks": {"epoch": 1, "pending": [[1, 0, 17]]}}
    for text in ("{nope", "[1]", '{"next_step": "3"}', '{"pending": [{"task": {}}]}', '{"done": 1}',
                 '{"tasksets": {"tasks": {"pending": []}}}', '{"tasksets": {"m": {"epoch": 0, "taken": 3}}}',
                 '{"awaiting": {"step": 1, "requests": [1]}}', '{"next_step": -4}',
                 '{"next_step": 2, "in_flight": [{"step": 1, "requests": "s1-a"}]}',
                 '{"next_step": 2, "in_flight": [{"step": 9, "requests": []}]}',
                 '{"next_step": 2, "in_flight": [{"step": 1, "requests": [], "eval": 3}]}', '{"waiting": 1}'):
        with pytest.raises(InvalidRecordError):
            ExplorerState.from_json(text)


def test_explorer_state_lists_rounds_in_flight_and_reads_an_older_explorers_awaiting_step():
    rounds = [{"step": 3, "requests": ["s3-a"], "results_offsets": {"0": 7}},
              {"step": 2, "requests": ["eval-m-s2-x"], "results_offsets": {}, "eval": "m"},
              {"step": 4, "requests": ["s4-a"], "results_offsets": {"0": 9}}]
    state = ExplorerState(next_step=5, finished_step=2, in_flight=rounds, waiting="weights v3 (has v2)")
    assert ExplorerState.from_json(state.to_json()) == state and state.steps_in_flight == [3, 4]
    older = '{"next_step": 4, "finished_step": 2, "awaiting": {"step": 3, "requests": ["s3-a"]}}'
    assert ExplorerState.from_json(older).in_flight == [{"step": 3, "requests": ["s3-a"]}]
    assert ExplorerState.from_json('{"next_step": 4, "awaiting": null}').in_flight == []


def test_sync_signals_are_checked_against_the_run_transport():
    check_sync(SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=3, method=SyncMethod.OBJECT_STORE),
               weights_method="object_store")
    ready = SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE, uri="tcp://h:1",
                       state=json.dumps({"session": "ab12", "receivers": 2, "backend": "gloo"}))
    check_sync(ready, weights_method="collective")
    assert reason_of(check_sync, ready, weights_method="object_store") == "wrong-transport"
    collective = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=3, method=SyncMethod.COLLECTIVE)
    assert reason_of(check_sync, collective, weights_method="object_store") == "wrong-transport"
    check_sync(collective, weights_method="collective", weights_url="file:///w")
    delivered = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=3, method=SyncMethod.COLLECTIVE, lineage="a",
                           state=json.dumps({"epoch": 2, "receivers": ["w0/1"], "catch_up": "file:///elsewhere"}))
    assert reason_of(check_sync, delivered, weights_method="collective", weights_url="file:///w") == \
        "missing-sha256"
    assert reason_of(check_sync, replace(delivered, sha256="a" * 64), weights_method="collective",
                     weights_url="file:///w") == "foreign-uri"
    assert reason_of(check_sync, replace(delivered, state='{"epoch": -1}'), weights_method="collective",
                     weights_url="file:///w") == "bad-state"
    assert reason_of(check_control, SyncSignal(kind=SyncKind.CANCEL_STEP, version=-2)) == "out-of-range"
    assert reason_of(check_control, SyncSignal(kind=SyncKind.EXPLORER_STATE, version=0, state="{x")) == "bad-state"
    # each writer's kinds on its own topic only: the trainer's on sync, the explorer's on control
    assert reason_of(check_sync, SyncSignal(kind=SyncKind.CANCEL_STEP, version=0)) == "wrong-topic"
    assert reason_of(check_sync, SyncSignal(kind=SyncKind.EXPLORER_STATE, version=0, state="{}")) == "wrong-topic"
    assert reason_of(check_control, SyncSignal(kind=SyncKind.SYNC_REQUEST, version=1)) == "wrong-topic"
    bad_ready = SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE, uri="tcp://h:1",
                           state="{}")
    assert reason_of(check_sync, bad_ready, weights_method="collective") == "bad-announcement"


def test_a_new_trainer_lineage_supersedes_whatever_its_version():
    old = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=7, lineage="a")
    assert supersedes(None, old)
    assert supersedes(old, SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=8, lineage="a"))
    assert not supersedes(old, SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=7, lineage="a"))
    assert not supersedes(old, SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=5, lineage="a"))
    assert supersedes(old, SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=5, lineage="b"))
    # the same version announced again with another manifest: loading tells which one is real
    assert supersedes(old, SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=7, lineage="a", sha256="f" * 64))


def test_object_store_weights_must_point_into_the_run_store_with_a_sha256(tmp_path):
    store = (tmp_path / "weights").as_uri()
    good = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=4, method=SyncMethod.OBJECT_STORE, lineage="L1",
                      uri=f"{store}/v00000004-L1/manifest.json", sha256="a" * 64)
    check_sync(good, weights_method="object_store", weights_url=store)
    for changes, reason in (({"sha256": ""}, "missing-sha256"),
                            ({"uri": (tmp_path / "elsewhere").as_uri() + "/v00000004-L1/manifest.json"}, "foreign-uri"),
                            ({"uri": f"{store}/../weights/v00000004-L1/manifest.json"}, "foreign-uri"),
                            ({"uri": f"http://example.invalid/v00000004-L1/manifest.json"}, "foreign-uri"),
                            ({"version": 5}, "foreign-uri"),  # v4's files announced as v5
                            ({"lineage": "../x"}, "foreign-uri")):
        signal = SyncSignal(**{**good.to_dict(), **changes})
        assert reason_of(check_sync, signal, weights_method="object_store", weights_url=store) == reason, changes


def test_the_ledger_knows_only_its_own_groups_letters():
    def letter(offset, group):
        made = dead_letter(topic="rft.x.tasks", partition=0, offset=offset, key=b"k", value=b"v", error="e",
                           reason="r", stage="decode", group=group)
        return SimpleNamespace(headers=made.headers)

    foreign = SimpleNamespace(headers=[("something", b"else")])
    ledger = DeadLetterLedger.from_letters("x.explorer", [letter(3, "x.explorer"), letter(4, "x.trainer"), foreign])
    assert ("rft.x.tasks", 0, 3) in ledger and ("rft.x.tasks", 0, 4) not in ledger and len(ledger) == 1
    ledger.add(("rft.x.tasks", 0, 9))
    assert ("rft.x.tasks", 0, 9) in ledger


def test_a_sync_request_counts_only_up_to_what_its_trainer_published():
    """trainer_driven paces on SYNC_REQUEST; one for a version never published (forged, or of another lineage)
    must not let the explorer run ahead or send workers waiting for weights that never come."""
    from streamrft.sync import SyncView

    view = SyncView.__new__(SyncView)  # only the signal bookkeeping: no consumer
    view.weights = view.requested = view.collective_ready = None
    view._cancels, view._cancelled = set(), -1
    view._apply(SyncSignal(kind=SyncKind.SYNC_REQUEST, version=4, lineage="a"))
    assert view.requested_version == 0  # nothing published yet
    view._apply(SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=4, lineage="a"))
    assert view.requested_version == 4
    view._apply(SyncSignal(kind=SyncKind.SYNC_REQUEST, version=10**9, lineage="a"))
    assert view.requested_version == 4
    view._apply(SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=1, lineage="b"))  # a resumed trainer
    assert view.requested_version == 0
