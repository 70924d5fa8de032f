"""No record on any topic stops a role. For each topic the loop reads (tasks, rollouts, experiences, results,
sync, metrics) and each kind of bad record (a key that is not UTF-8, a garbage value, the wrong record type,
a record that decodes but breaks its invariants, an oversized one) the consuming role stays up, the record is
in ``<topic>.dlq`` exactly once with a reason, and the good records around it are processed. Restarting the
roles does not dead-letter anything again."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrft.consumers.explorer import Explorer
from streamrft.consumers.monitor import Monitor
from streamrft.consumers.rollout import RolloutWorker
from streamrft.consumers.trainer import Trainer
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import (Experience, Metric, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus,
                               SingleObjectCodec, SyncKind, SyncSignal, Task, pack_f32, pack_i32)
from .roles import RoleThread, produce_tasks

pytestmark = [pytest.mark.kafka, pytest.mark.model]
CODEC = SingleObjectCodec()
STEPS = 3


def _task(task_id="t", payload="{}") -> Task:
    return Task(task_id=task_id, workflow="arithmetic", payload=payload)


def _experience(**changes) -> Experience:
    fields = dict(eid="x/0", group_id="x", task_id="x", step=0, kind=RolloutKind.TRAIN, run_index=0,
                  model_version=0, tokens=pack_i32([5, 6, 7, 8]), prompt_length=2, logprobs=pack_f32([-1, -1]),
                  reward=1.0, group_size=4)
    return Experience(**{**fields, **changes})


def bad_records() -> dict[str, dict[str, tuple[bytes, bytes]]]:
    """topic -> {what: (key, value)}: the five kinds of bad record for each topic."""
    def same(topic_record, wrong, invalid, oversized):
        return {"non-utf8-key": (b"\xff\xfe-key", CODEC.encode(topic_record)),
                "garbage": (b"garbage", b"\x07not an avro record at all"),
                "wrong-type": (b"wrong", CODEC.encode(wrong)),
                "invalid": (b"invalid", CODEC.encode(invalid)),
                "oversized": (b"oversized", CODEC.encode(oversized))}

    metric = Metric(source="s", role="r", name="n", value=1.0, step=0)
    request = RolloutRequest(request_id="r-ok", step=0, kind=RolloutKind.TRAIN, task=_task(), repeat_times=4)
    result = RolloutResult(request_id="nobody", step=0, task_id="t", status=RolloutStatus.OK, n=4,
                           model_version=0, duration_ms=1)
    return {
        "tasks": same(_task("key-test"), metric, _task("", "{}"), _task("big", json.dumps({"q": "x" * 8000}))),
        "rollouts": same(request, metric,
                         RolloutRequest(request_id="neg", step=-5, kind=RolloutKind.TRAIN, task=_task(),
                                        repeat_times=4),
                         RolloutRequest(request_id="big", step=0, kind=RolloutKind.TRAIN,
                                        task=_task("big", json.dumps({"q": "x" * 8000})), repeat_times=4)),
        "experiences": same(_experience(), metric, _experience(eid="bad/0", prompt_length=9),
                            _experience(eid="long/0", tokens=pack_i32([5] * 2000),
                                        logprobs=pack_f32([-1.0] * 1998))),
        "results": same(result, metric,
                        RolloutResult(request_id="nan", step=0, task_id="t", status=RolloutStatus.OK, n=4,
                                      model_version=0, duration_ms=1, reward_mean=float("nan")),
                        RolloutResult(request_id="big", step=0, task_id="t", status=RolloutStatus.FAILED,
                                      n=0, model_version=0, duration_ms=1, error="e" * 100_000)),
        "sync": same(SyncSignal(kind=SyncKind.SYNC_REQUEST, version=10**9), metric,
                     SyncSignal(kind=SyncKind.CANCEL_STEP, version=0),  # the explorer's kind, on the trainer's topic
                     SyncSignal(kind=SyncKind.NCCL_READY, version=0, state="x" * 300_000)),
        "control": same(SyncSignal(kind=SyncKind.CANCEL_STEP, version=10**9), metric,
                        SyncSignal(kind=SyncKind.EXPLORER_STATE, version=0, state="{not json"),
                        SyncSignal(kind=SyncKind.EXPLORER_STATE, version=0, state="x" * 300_000)),
        "metrics": same(metric, _task(), Metric(source="s", role="r", name="n", value=float("inf"), step=0),
                        Metric(source="s", role="r", name="n" * 10_000, value=1.0, step=0)),
    }


def _inject(clients, config, topic: str, records: dict[str, tuple[bytes, bytes]]) -> dict[int, str]:
    """Produce the bad records (the non-UTF-8 key one carries a *valid* value: only its key is bad); returns
    offset -> what, found by reading the topic back (keys are unique per topic)."""
    producer = clients.producer()
    for key, value in records.values():
        producer.produce_raw(config.topic(topic), value, key, partition=0)
    producer.flush()
    what_of = {key: what for what, (key, _) in records.items()}
    # a read_committed reader stops at the last stable offset: while a role's transaction is open on the
    # partition (a worker writing results), records produced after it begins are not visible yet
    deadline = time.monotonic() + 60
    while True:
        offsets = {raw.offset: what_of[raw.key] for raw in read_to_end(config.kafka, clients.bootstrap,
                                                                       config.topic(topic))
                   if raw.key in what_of and raw.partition == 0}
        if sorted(offsets.values()) == sorted(records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(offsets.values()) == sorted(records)
    return offsets


def _letters(clients, config, topic: str) -> Counter:
    """(source offset, reason) of every dead letter of ``topic`` (the bad records are all on partition 0)."""
    out = Counter()
    for raw in read_to_end(config.kafka, clients.bootstrap, config.topic(topic) + ".dlq"):
        headers = dict(raw.headers)
        assert headers["streamrft.source.partition"] == b"0"
        out[(int(headers["streamrft.source.offset"]), headers["streamrft.reason"].decode())] += 1
    return out


def test_no_bad_record_stops_a_role_and_each_is_dead_lettered_once(run_config, tiny_model_dir, tmp_path: Path):
    config = run_config(
        model={"path": str(tiny_model_dir)},
        explorer={"batch_size": 2, "repeat_times": 4, "max_steps": STEPS, "metrics_port": None},
        rollout={"sampling": {"max_tokens": 3}, "metrics_port": None},
        trainer={"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                 "micro_batch_size": 8, "total_steps": STEPS},
        monitor={"output_dir": str(tmp_path / "out"), "metrics_port": None, "tensorboard": False},
        limits={"max_task_bytes": 4096})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    bad = bad_records()
    injected = {topic: _inject(clients, config, topic, records) for topic, records in bad.items()
                if topic != "results"}
    # a well-formed but absurd CANCEL_STEP: honoured, it would cancel every step and nothing would be trained
    absurd = clients.producer()
    absurd.produce(config.topic("control"), SyncSignal(kind=SyncKind.CANCEL_STEP, version=10**6, source="x"))
    absurd.flush()
    produce_tasks(clients, config, [Task(task_id=f"q{i}", workflow="arithmetic",
                                         payload=json.dumps({"question": "1 + 1", "answer": "2"}))
                                    for i in range(STEPS * 2)])

    def start_all():
        return {"worker": RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start(),
                "explorer": RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start(),
                "trainer": RoleThread("trainer", lambda stop: Trainer(config, clients, stop)).start(),
                "monitor": RoleThread("monitor", lambda stop: Monitor(config, clients, stop)).start()}

    roles = start_all()
    # the explorer reads results from where its step starts: inject the bad results once it is under way
    deadline = time.monotonic() + 120
    while roles["explorer"].role is None or roles["explorer"].role.state.next_step < 1:
        assert time.monotonic() < deadline and roles["explorer"].thread.is_alive(), roles["explorer"].error
        time.sleep(0.2)
    injected["results"] = _inject(clients, config, "results", bad["results"])

    roles["trainer"].join(300)
    roles["explorer"].join(120)
    assert roles["trainer"].result == STEPS  # every step trained: the good records around the bad ones
    assert roles["explorer"].result.done and roles["explorer"].result.next_step == STEPS
    time.sleep(2)  # the monitor exports the last metrics, then stops
    for name in ("worker", "monitor"):
        roles[name].stop.request()
        roles[name].join(60)
    assert roles["monitor"].role.exported > 0

    first = {topic: _letters(clients, config, topic) for topic in bad}
    for topic, offsets in injected.items():
        letters = first[topic]
        assert sorted(o for o, _ in letters) == sorted(offsets), (topic, letters, offsets)
        assert all(count == 1 for count in letters.values()), (topic, letters)
        reasons = {offsets[o]: reason for o, reason in letters}
        assert reasons["wrong-type"] == "wrong-record-type"
        assert reasons["oversized"] == "oversized", (topic, reasons)
        assert reasons["non-utf8-key"] == "decode-error", reasons

    # Restart every role: the explorer re-reads sync and control from the beginning, the trainer resumes, the monitor and
    # worker rejoin their groups. Nothing is dead-lettered a second time.
    again = start_all()
    again["explorer"].join(60)
    again["trainer"].join(120)
    time.sleep(2)
    for name in ("worker", "monitor"):
        again[name].stop.request()
        again[name].join(60)
    assert {topic: _letters(clients, config, topic) for topic in bad} == first
    clients.close()


def test_the_bench_skips_bad_results_and_dead_letters_each_once(run_config, tmp_path: Path):
    """`streamrft bench` reads `results` of its namespace: the five kinds of bad record there go to its DLQ
    once each, with a reason, and the result it waits for still arrives."""
    from streamrft.consumers.bench import Bench, Evaluation
    from streamrft.lifecycle import StopSignal

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"question": "1 + 1", "answer": 2}) + "\n")
    config = run_config(explorer={"eval_tasksets": [{"name": "mini", "path": str(eval_file)}]})
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    bench = Bench(config, clients, StopSignal(signals=()), timeout_s=60)
    try:
        offsets = _inject(clients, config, "results", bad_records()["results"])
        producer = clients.producer()
        producer.produce(config.topic("results"), RolloutResult(request_id="wanted", step=0, task_id="t",
                                                                status=RolloutStatus.OK, n=1, model_version=0,
                                                                duration_ms=1), partition=0)
        producer.flush()
        evaluation = Evaluation(0, {"wanted": (config.explorer.eval_tasksets[0], None)}, time.monotonic() + 60)
        while not evaluation.done:
            bench.collect(evaluation)
        assert list(evaluation.results) == ["wanted"]
    finally:
        bench.close()
    letters = _letters(clients, config, "results")
    assert sorted(o for o, _ in letters) == sorted(offsets) and all(c == 1 for c in letters.values())
    reasons = {offsets[o]: reason for o, reason in letters}
    assert reasons["invalid"] != "decode-error" and reasons["wrong-type"] == "wrong-record-type"
    clients.close()
