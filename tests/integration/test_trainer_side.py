"""The trainer role on the real broker with a tiny real model: learning, exact resume after SIGKILL, weight
publishing (object store and collective), refusal of corrupted weights, short batches, fan-out and replay."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from streamrft.config import load_config
from streamrft.errors import ConfigError
from streamrft.lifecycle import StopSignal
from streamrft.consumers.trainer.checkpoints import Checkpoints
from streamrft.consumers.trainer.group_buffer import GroupBuffer
from streamrft.consumers.trainer import (
    ReplayStart,
    Trainer,
    parse_replay_from,
)
from streamrft.pacing import Pacing
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Delivered
from streamrft.schemas import (
    Experience,
    Metric,
    RolloutKind,
    SyncKind,
    SyncMethod,
    SyncSignal,
    pack_f32,
    pack_i32,
)

from .roles import RoleThread, read_all, train_beside_a_child, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.model]

PROMPT = [5, 6, 7, 8]


# ----------------------------------------------------------------------------------------------------- helpers
def _settings(tiny_model_dir, ckpt: Path, *, trainer: dict | None = None, explorer: dict | None = None,
              sync: dict | None = None) -> dict:
    """Overrides of a run config (also written as YAML for trainer subprocesses)."""
    return {
        "model": {"path": str(tiny_model_dir)},
        "sync": sync or {},
        "explorer": {"batch_size": 2, "repeat_times": 4, "metrics_port": None, **(explorer or {})},
        "rollout": {"sampling": {"max_tokens": 3}, "metrics_port": None},
        "trainer": {"checkpoint_dir": str(ckpt), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                    "micro_batch_size": 8, **(trainer or {})},
    }


def _clients(config) -> KafkaClients:
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    return clients


def make_group(step: int, index: int, size: int = 4, version: int | None = None, seed: int = 0) -> list[Experience]:
    """One GRPO group of synthetic experiences (random 3-token responses, rewards 0/1), sampled by weights
    ``version`` (default: ``step``, as fixed pacing with sync_interval 1 does)."""
    version = step if version is None else version
    rng = random.Random(f"{seed}-{step}-{index}")
    group_id = f"s{step}-t{index}"
    out = []
    for run in range(size):
        response = [rng.randrange(3, 90) for _ in range(3)]
        out.append(Experience(eid=f"{group_id}/{run}", group_id=group_id, task_id=f"t{index}", step=step,
                              kind=RolloutKind.TRAIN, run_index=run, model_version=version,
                              tokens=pack_i32(PROMPT + response), prompt_length=len(PROMPT),
                              logprobs=pack_f32([-4.5] * 3), reward=float(run % 2 == rng.randrange(2)),
                              group_size=size))
    return out


def produce(clients, config, experiences) -> None:
    producer = clients.producer()
    for exp in experiences:
        producer.produce(config.topic("experiences"), exp)
    producer.flush()


def steps_of(first: int, last: int, groups: int = 2, seed: int = 0) -> list[Experience]:
    return [e for s in range(first, last + 1) for g in range(groups) for e in make_group(s, g, seed=seed)]


def trainer_thread(config, clients, **kwargs) -> RoleThread:
    return RoleThread(f"trainer-{kwargs.get('group') or 'main'}",
                      lambda stop: Trainer(config, clients, stop, **kwargs)).start()


def trainer_process_setup(run_config, settings: dict, tmp_path: Path):
    """For a trainer in a subprocess: the config, clients, the config written as YAML and the environment."""
    config = run_config(**settings)
    clients = _clients(config)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"name": config.name, **settings}))
    env = {**os.environ, "STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": config.kafka.bootstrap_servers,
           "STREAMRFT_LOG_LEVEL": "INFO", "COLUMNS": "400"}
    return config, clients, config_file, env


def audit_eids(root: Path) -> list[str]:
    return [eid for entry in Checkpoints(root, 1).audit() for eid in entry["eids"]]


# ------------------------------------------------------------------------------------- no broker, no model
@pytest.mark.parametrize("text, expected", [
    ("0", ReplayStart(offset=0)), ("1200", ReplayStart(offset=1200)), ("earliest", ReplayStart(offset=0)),
    ("1767225600000", ReplayStart(timestamp_ms=1767225600000)),
    ("2026-01-01T00:00:00Z", ReplayStart(timestamp_ms=1767225600000)),
    ("2026-01-01T00:00:00", ReplayStart(timestamp_ms=1767225600000)),
    ("2026-01-01T01:00:00+01:00", ReplayStart(timestamp_ms=1767225600000)),
])
def test_replay_from_parses_offsets_and_times(text, expected):
    assert parse_replay_from(text) == expected


def test_staleness_bound_covers_fixed_pacing():
    def bound(**sync):
        return Pacing.of(load_config(overrides={"sync": sync}, env={})).staleness_bound

    assert bound(style="fixed", interval=1, max_staleness=1) == 1
    assert bound(style="fixed", interval=4, offset=1, max_staleness=1) == 4
    assert bound(style="fully_async", interval=4, max_staleness=2) == 2


def test_group_buffer_completes_orders_and_holds_offsets():
    buffer = GroupBuffer(default_group_size=4)
    items = {}
    for step, index, partition, base in ((1, 0, 0, 10), (0, 1, 1, 20), (0, 2, 0, 30)):
        for k, exp in enumerate(make_group(step, index, size=2 if index == 2 else 4)):
            items.setdefault(exp.group_id, []).append(Delivered(exp, "x", partition, base + k, exp.group_id, 0))
    for item in items["s1-t0"] + items["s0-t1"][:3] + items["s0-t2"]:
        assert buffer.add(item, now=0.0)
    assert not buffer.add(items["s1-t0"][0])  # duplicate eid
    assert [g.group_id for g in buffer.complete_groups()] == ["s0-t2", "s1-t0"]  # oldest step first
    assert [g.group_id for g in buffer.expired(now=5.0, timeout_s=5.0)] == ["s0-t1"]
    assert buffer.low_water() == {("x", 0): 10, ("x", 1): 20}
    buffer.remove(buffer.complete_groups())
    assert len(buffer) == 3 and buffer.low_water() == {("x", 1): 20}


def test_checkpoints_ignore_interrupted_saves_prune_and_truncate_the_audit(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    offsets = {("t", 0): 5}
    for step in (0, 1, 2):
        write = (lambda d, step=step: torch.save({"w": torch.full((2,), float(step))}, d / "engine.pt"))
        checkpoints.save(step, write if step else None, offsets,
                         [{"topic": "t", "partition": 0, "offset": 3, "timestamp_ms": 0, "value": b"\xc3\x01x"}], {})
        if step:
            checkpoints.record(step - 1, step, [f"e{step}"], [])
    (tmp_path / ".tmp-step-00000003-dead").mkdir()  # a save killed half-way: no state.json, never used
    (tmp_path / ".tmp-step-00000003-dead" / "engine.pt").write_bytes(b"partial")
    (tmp_path / "step-00000004").mkdir()  # not renamed into place by the saver: incomplete, ignored
    with open(checkpoints.audit_path, "a") as fh:
        fh.write('{"step": 2, "version": 3, "eids": ["e3"]}\n{"step": 3, "vers')  # lost steps, a torn line
    assert checkpoints.steps() == [1, 2] and checkpoints.latest().name == "step-00000002"
    checkpoint = checkpoints.load(checkpoints.latest())
    state = torch.load(checkpoint.path / "engine.pt")
    assert checkpoint.step == 2 and checkpoint.has_model and checkpoint.offsets == offsets
    assert torch.equal(state["w"], torch.full((2,), 2.0))
    assert checkpoint.buffered[0]["value"] == b"\xc3\x01x"
    assert checkpoints.truncate_audit(checkpoint.step) == 2
    assert [e["eids"] for e in checkpoints.audit()] == [["e1"], ["e2"]]
    checkpoints.save(5, None, offsets, [], {})
    assert checkpoints.steps() == [2, 5] and not list(tmp_path.glob(".tmp-*"))


# ------------------------------------------------------------------------------------------- with the broker
@pytest.mark.parametrize("engine, lora", [("transformers", False), ("transformers", True),
                                          pytest.param("vllm", False, marks=pytest.mark.vllm)])
def test_grpo_through_explorer_workers_and_trainer_raises_the_reward(run_config, tiny_model_dir, tmp_path, engine,
                                                                      lora):
    """Reward 1 when the response starts with a digit (~10 % for the random tiny model): 20 fixed-pacing steps,
    each trained on the previous weights, must raise it clearly — with either rollout engine, and with LoRA
    (adapters published, merged by the worker).

    LoRA leaves the tied embeddings / output head alone, and with the tiny model's initialisation (std 0.02)
    they bound the logits too tightly for adapters to move them: the LoRA run's model is initialised at std
    0.1, nearer a trained model's logit range (measured: reward 0.21 -> 0.69 over the first and last 5 steps)."""
    from streamrft.consumers.explorer import Explorer
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.engines.models import build_tiny_model, build_tiny_tokenizer
    from streamrft.engines.workflows import SingleTurnWorkflow, register_workflow, unregister_workflow
    from streamrft.engines.workflows.rewards import Reward
    from streamrft.schemas import Task

    digits = set(build_tiny_tokenizer().convert_tokens_to_ids(list("0123456789")))

    @register_workflow("test-first-digit", replace=True)
    class FirstDigit(SingleTurnWorkflow):
        def messages(self, payload):
            return [{"role": "user", "content": payload["question"]}]

        def score_sample(self, completion, payload):
            hit = bool(completion.response_ids) and completion.response_ids[0] in digits
            return Reward(float(hit), correct=hit)

    steps = 20
    model_dir = build_tiny_model(tmp_path / "model", seed=0, initializer_range=0.1) if lora else tiny_model_dir
    settings = _settings(
        model_dir, tmp_path / "ckpt",
        explorer={"batch_size": 4, "repeat_times": 8, "max_steps": steps}, sync={"style": "fixed", "interval": 1},
        trainer={"lr": 5e-2 if lora else 1e-2, "micro_batch_size": 32, "total_steps": steps, "save_interval": 100,
                 "algorithm": {"clip_high": 0.28}})
    settings["rollout"].update(engine=engine, vllm={"kv_cache_gib": 1, "enforce_eager": True, "max_model_len": 256})
    if lora:
        settings["model"]["lora"] = {"rank": 8, "alpha": 16.0}
    config = run_config(**settings)
    clients = _clients(config)
    producer = clients.producer()
    for i in range(steps * 4):
        producer.produce(config.topic("tasks"), Task(task_id=f"q{i}", workflow="test-first-digit",
                                                     payload=json.dumps({"question": "Say a number."})))
    producer.flush()
    try:
        started = time.monotonic()
        worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
        explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
        trainer = trainer_thread(config, clients)
        wait_for(trainer, [worker, explorer], 240)
        wait_for(explorer, [worker], 60)
        elapsed = time.monotonic() - started
        served_version = worker.role.engine.version
        served = {name: t.clone() for name, t in worker.role.engine.state_dict().items()}
        worker.stop.request()
        worker.join(60)
    finally:
        unregister_workflow("test-first-digit")

    assert trainer.result == steps
    metrics = [m for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
               if m.role == "trainer" and m.name == "actor/reward_mean"]
    reward = {m.step: m.value for m in metrics}
    assert sorted(reward) == list(range(steps))
    first, last = (sum(reward[s] for s in r) / 5 for r in (range(5), range(steps - 5, steps)))
    print(f"\nreward first 5 steps {first:.3f} -> last 5 steps {last:.3f}; {steps} steps in {elapsed:.1f}s")
    assert last > first + 0.3, (first, last)
    # every trainer step used the weights of the step before (fixed pacing, sync_interval 1): nothing stale
    staleness = [m.value for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=0.5)
                 if m.name == "trainer/staleness"]
    assert staleness and max(staleness) == 0
    assert served_version >= steps - 1
    from safetensors.torch import load_file

    initial = load_file(str(model_dir / "model.safetensors"))
    trained = dict(trainer.role.engine.named_weights())
    if lora:  # the worker serves the base weights with the last adapter merged in
        signals = read_all(config, clients.bootstrap, "sync", clients.serde, SyncSignal, idle=0.5)
        assert all(s.nbytes < 200_000 for s in signals if s.kind == SyncKind.WEIGHTS_PUBLISHED)  # adapters only
        assert all(".lora_" in name for name in trained)
        trained = served
    assert any(not torch.equal(initial[name], trained[name]) for name in initial if name in trained)
    clients.close()


@pytest.mark.parametrize("ranks", [
    pytest.param({}, id="one-process"),
    # torchrun, 2 gloo ranks, FSDP2: rank 0 reads and commits; the checkpoint is sharded
    pytest.param({"nproc": 2, "parallel": "fsdp"}, id="fsdp-2-ranks"),
])
def test_resume_after_sigkill_trains_every_experience_exactly_once(run_config, tiny_model_dir, tmp_path, ranks):
    ckpt = tmp_path / "ckpt"
    settings = _settings(tiny_model_dir, ckpt, trainer={"total_steps": 12, "save_interval": 4, **ranks})
    config, clients, config_file, env = trainer_process_setup(run_config, settings, tmp_path)
    everything = steps_of(0, 11)
    produce(clients, config, everything[: 5 * 8 + 4])  # five batches and one group of the sixth

    def start(log_name: str) -> subprocess.Popen:
        log = open(tmp_path / log_name, "w")
        return subprocess.Popen([sys.executable, "-m", "streamrft.cli", "train", str(config_file)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)

    checkpoints = Checkpoints(ckpt, 2)
    first = start("first.log")
    try:
        deadline = time.monotonic() + 120
        while not any(entry["version"] == 5 for entry in checkpoints.audit()):
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the first run did not reach v5"
            time.sleep(0.1)
        time.sleep(0.3)
        assert 4 in checkpoints.steps()
        os.killpg(first.pid, signal.SIGKILL)  # v5 is trained (and committed) but not checkpointed; every rank dies
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    produce(clients, config, everything[5 * 8 + 4:])
    second = start("second.log")
    assert second.wait(120) == 0, (tmp_path / "second.log").read_text()
    log = (tmp_path / "second.log").read_text()
    # it resumed from checkpoint 4 (with the experiences it had read but not trained) and forgot v5
    assert "step-00000004: 4 steps done" in log and "1 audit entry of lost steps removed" in log, log

    audit = checkpoints.audit()
    assert [(entry["step"], entry["version"]) for entry in audit] == [(s, s + 1) for s in range(12)]
    eids = audit_eids(ckpt)
    assert len(eids) == len(set(eids)) == len(everything)  # nothing trained twice
    assert set(eids) == {e.eid for e in everything}  # nothing skipped
    assert checkpoints.steps()[-1] == 12
    if ranks:
        assert "trainer rank 1 of 2 on cpu (fsdp)" in log, log
        assert (checkpoints.latest() / "engine" / ".metadata").is_file()  # torch.distributed.checkpoint shards
    clients.close()


def test_graceful_stop_checkpoints_the_buffer_and_resume_restores_it(run_config, tiny_model_dir, tmp_path):
    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt", trainer={"total_steps": 2}))
    clients = _clients(config)
    produce(clients, config, make_group(0, 0) + make_group(0, 1) + make_group(1, 0))
    trainer = trainer_thread(config, clients)
    deadline = time.monotonic() + 60
    while trainer.role is None or trainer.role.step < 1 or len(trainer.role.buffer) < 4:
        assert time.monotonic() < deadline and trainer.thread.is_alive()
        time.sleep(0.1)
    trainer.stop.request()  # what SIGINT/SIGTERM do through StopSignal
    trainer.join(30)
    state = json.loads((config.checkpoint_dir / "step-00000001" / "state.json").read_text())
    assert state["has_model"] and state["buffered"] == 4

    produce(clients, config, make_group(1, 1))
    resumed = trainer_thread(config, clients)
    resumed.join(60)
    assert resumed.result == 2
    eids = audit_eids(config.checkpoint_dir)
    assert sorted(eids) == sorted(e.eid for s in (0, 1) for g in (0, 1) for e in make_group(s, g))
    assert resumed.role.engine.step == 2  # model, optimiser and schedule went on from the checkpoint
    clients.close()


def test_sigterm_stops_the_ranks_of_a_distributed_trainer_with_a_sharded_checkpoint(run_config, tiny_model_dir,
                                                                                    tmp_path):
    """What `streamrft run` and Kubernetes do to stop a trainer: SIGTERM to torchrun, which passes it on. Rank 0
    finishes its step and checkpoints with the other rank (its shard), then stops it."""
    ckpt = tmp_path / "ckpt"
    settings = _settings(tiny_model_dir, ckpt, trainer={"total_steps": 5, "nproc": 2, "parallel": "fsdp"})
    config, clients, config_file, env = trainer_process_setup(run_config, settings, tmp_path)
    produce(clients, config, steps_of(0, 0) + make_group(1, 0))
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log:
        trainer = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "train", str(config_file)], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        checkpoints = Checkpoints(ckpt, 2)
        deadline = time.monotonic() + 120
        while not checkpoints.audit() or "buffered" not in log_path.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        time.sleep(1)  # the half step's group is read
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(90)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    log = log_path.read_text()
    # torchrun itself exits 1 after passing on a signal, however cleanly its ranks stopped; both ranks exited 0
    assert "stopped by rank 0" in log and "failed" not in log.lower(), log
    state = json.loads((ckpt / "step-00000001" / "state.json").read_text())
    assert state["has_model"] and state["buffered"] == 4, log
    assert (ckpt / "step-00000001" / "engine" / ".metadata").is_file()
    clients.close()


def _assert_same_weights(served: dict[str, torch.Tensor], trainer: Trainer) -> None:
    expected = dict(trainer.engine.named_weights())
    assert expected
    for name, tensor in expected.items():
        assert torch.equal(served[name].cpu(), tensor.cpu()), name


def test_object_store_publish_swaps_a_rollout_worker_and_refuses_corrupt_shards(run_config, tiny_model_dir,
                                                                                  tmp_path):
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.engines.weights.object_store import ObjectStore
    from streamrft.sync import SyncView

    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt", trainer={"total_steps": 1}))
    clients = _clients(config)
    produce(clients, config, steps_of(0, 0))
    trainer = trainer_thread(config, clients)
    trainer.join(120)
    view = SyncView(clients, client_id="test-sync")
    view.catch_up()
    signal_v1 = view.weights
    view.close()
    assert signal_v1.version == 1 and signal_v1.method == SyncMethod.OBJECT_STORE and signal_v1.source == "trainer"

    worker = RolloutWorker(config, clients, StopSignal(), "w0")

    def load(signal) -> bool:
        worker.sync.weights = signal  # as if the worker's view had just read it
        return worker.weights.swap_to_latest(worker.sync)

    try:
        assert load(signal_v1) and worker.engine.version == 1
        _assert_same_weights(worker.engine.state_dict(), trainer.role)

        # the trainer's own lineage: what a corrupted upload of a real later version would carry
        store = ObjectStore(config.weights_url, lineage=signal_v1.lineage, keep_last=5, max_shard_bytes=64 << 10)
        shifted = {n: t + 0.5 for n, t in trainer.role.engine.named_weights()}
        for version, damage in ((2, "corrupt"), (3, "truncate")):
            published = store.publish(shifted.items(), version=version)
            shard = sorted((Path(published.uri.removeprefix("file://")).parent).glob("*.safetensors"))[-1]
            data = bytearray(shard.read_bytes())
            if damage == "corrupt":
                data[len(data) // 2] ^= 0xFF
            else:
                data = data[: len(data) - 100]
            shard.write_bytes(bytes(data))
            bad = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.OBJECT_STORE,
                             uri=published.uri, sha256=published.sha256, nbytes=published.nbytes,
                             lineage=signal_v1.lineage)
            assert load(bad) is False, damage
            assert [r.reason for r in worker.weights.take_refusals()] == ["integrity"], damage
            assert worker.engine.version == 1
            _assert_same_weights(worker.engine.state_dict(), trainer.role)  # the old weights stay
    finally:
        worker.close()
    clients.close()


def collective_receiver(bootstrap: str, overrides: dict, out: str, version: int, record: str = "weights",
                        die_in: int = 0, registered: str = "") -> None:
    """Child process: a rollout worker (its engine from the config) that follows `sync`, registers with the
    trainer's weight-sync group when it is announced, swaps to each version up to ``version`` and saves to
    ``out`` either its weights and how many versions it caught up from the object store (``record="weights"``)
    or samples of them with their logprobs (``"samples"``). ``die_in``: SIGKILL itself in the middle of that
    version's broadcast (after its header, before its buckets); ``registered``: a file touched once it has
    registered."""
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.engines.inference import SamplingParams
    from streamrft.engines.weights import collective

    if die_in:
        whole = collective.ReceivedWeights.__iter__

        def dying(self):
            if self.version == die_in:
                os.kill(os.getpid(), signal.SIGKILL)
            yield from whole(self)
        collective.ReceivedWeights.__iter__ = dying
    config = load_config(overrides=overrides, env={})
    clients = KafkaClients(config, bootstrap)
    worker = RolloutWorker(config, clients, StopSignal(), "receiver")
    caught_up_versions = []  # with collective sync every object-store load is a catch-up
    fetch = worker.weights._fetch_object_store
    worker.weights._fetch_object_store = lambda signal: caught_up_versions.append(signal.version) or fetch(signal)
    deadline = time.monotonic() + 150
    while worker.engine.version < version:
        assert time.monotonic() < deadline, f"weights v{version} never served (serving v{worker.engine.version})"
        worker.sync.poll(0.2)
        worker.weights.follow(worker.sync)
        worker.weights.swap_to_latest(worker.sync)
        receiver = worker.weights._receiver
        if registered and receiver is not None and receiver.registered.is_set():
            Path(registered).touch()
    assert worker.engine.version == version
    if record == "weights":
        caught_up = worker.weights.c_caught_up._value.get()
        assert caught_up == len(caught_up_versions), (caught_up, caught_up_versions)  # the metric counts them
        torch.save({"weights": {name: t.clone() for name, t in worker.engine.state_dict().items()},
                    "caught_up": caught_up_versions}, out)
    else:
        prompts = [[{"role": "user", "content": "What is 3 + 4?"}], [5, 9, 11]]
        rows = worker.engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=4), n=2)
        torch.save([(worker.engine.kind, c.prompt_ids, c.response_ids, c.logprobs, c.model_version)
                    for row in rows for c in row], out)
    worker.close()
    clients.close()


def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def start_collective_training(run_config, tiny_model_dir, tmp_path, timeout_s: float, rollout: dict | None = None,
                              *, steps: int = 2, weights: dict | None = None):
    """A trainer (thread) that trains ``steps`` steps (experiences of the first two are produced here) and
    broadcasts each version; returns the config, the clients, the trainer and the overrides a receiver process
    loads its config from."""
    overrides = _settings(tiny_model_dir, tmp_path / "ckpt", trainer={
        "total_steps": steps, "weights": {"method": "collective", "collective_timeout_s": timeout_s,
                                          **(weights or {})}})
    overrides["rollout"].update(rollout or {})
    config = run_config(**overrides)
    clients = _clients(config)
    produce(clients, config, steps_of(0, 1))
    trainer = trainer_thread(config, clients)
    child_overrides = {"name": config.name, "kafka": {"bootstrap_servers": config.kafka.bootstrap_servers},
                       **overrides}
    return config, clients, trainer, child_overrides


def test_collective_broadcast_reaches_a_receiver_process_over_gloo(run_config, tiny_model_dir, tmp_path):
    # the trainer and its receiver share the run's secret (the trainer admits only members that hold it)
    config, clients, trainer, child_overrides = start_collective_training(
        run_config, tiny_model_dir, tmp_path, 90, weights={"group_secret": "test-run-secret-0123456789"})
    out = tmp_path / "received.pt"
    train_beside_a_child(trainer, collective_receiver,
                         (config.kafka.bootstrap_servers, child_overrides, str(out), 2), 150, 60)
    received = torch.load(out, weights_only=True)
    _assert_same_weights(received["weights"], trainer.role)
    assert received["caught_up"] == []  # by broadcast, verified against its digest, not from the object store
    signals = [s for s in read_all(config, clients.bootstrap, "sync", clients.serde, SyncSignal, idle=1)]
    ready = [s for s in signals if s.kind == SyncKind.NCCL_READY]
    published = [s for s in signals if s.kind == SyncKind.WEIGHTS_PUBLISHED]
    assert len(ready) == 1 and json.loads(ready[0].state)["receivers"] == 1
    assert [(s.version, s.method, s.uri) for s in published] == [(v, SyncMethod.COLLECTIVE, ready[0].uri)
                                                                  for v in (1, 2)]
    assert [len(json.loads(s.state)["receivers"]) for s in published] == [1, 1]
    assert all(len(json.loads(s.state)["digest"]) == 64 for s in published)
    clients.close()


@pytest.mark.timeout(420)
def test_elastic_collective_sync_a_worker_killed_mid_broadcast_and_one_that_joins_late(run_config, tiny_model_dir,
                                                                                       tmp_path):
    """Two workers; one SIGKILLs itself in the middle of v2's broadcast; a third starts after v2. The trainer
    never waits past receiver_timeout_s for the dead one, and both live workers end on v3 with the trainer's
    exact tensors (the late one caught v2 up from the object store, then got v3 by broadcast)."""
    import multiprocessing

    timeout_s = 10.0
    config, clients, trainer, child_overrides = start_collective_training(
        run_config, tiny_model_dir, tmp_path, 120, steps=3,
        weights={"collective_receivers": 2, "receiver_timeout_s": timeout_s})
    spawn = multiprocessing.get_context("spawn")
    bootstrap = config.kafka.bootstrap_servers
    out = {name: tmp_path / f"{name}.pt" for name in "abc"}
    late_registered = tmp_path / "c.registered"
    children = {"a": spawn.Process(target=collective_receiver, args=(bootstrap, child_overrides, str(out["a"]), 3)),
                "b": spawn.Process(target=collective_receiver,
                                   args=(bootstrap, child_overrides, str(out["b"]), 3, "weights", 2))}
    try:
        for child in children.values():
            child.start()
        until(lambda: trainer.role is not None and trainer.role.published_version >= 2, 240,
              "the trainer never published v2")
        children["b"].join(30)
        assert children["b"].exitcode == -signal.SIGKILL
        children["c"] = spawn.Process(target=collective_receiver, args=(bootstrap, child_overrides, str(out["c"]),
                                                                        3, "weights", 0, str(late_registered)))
        children["c"].start()
        until(late_registered.exists, 120, "the late worker never registered")
        produce(clients, config, steps_of(2, 2))
        trainer.join(240)
        for name in "ac":
            children[name].join(120)
            assert children[name].exitcode == 0, name
    finally:
        for child in children.values():
            if child.is_alive():
                child.kill()
    received = {name: torch.load(out[name], weights_only=True) for name in "ac"}
    for name in "ac":
        _assert_same_weights(received[name]["weights"], trainer.role)
    metrics = {(m.name, m.step): m.value for m in read_all(config, clients.bootstrap, "metrics", clients.serde,
                                                             Metric, idle=1) if m.role == "trainer"}
    publish_s = [metrics["time/publish_weights", step] for step in range(3)]
    # the dead worker held no sync up past receiver_timeout_s (v1's publish also waits for the two workers to
    # start and register, collective_receivers: on a busy machine that alone can take longer)
    assert max(publish_s[1:]) < timeout_s + 5, publish_s
    receivers = [metrics["weights/broadcast_receivers", step] for step in range(3)]
    assert receivers[0] == 2 and receivers[2] == 2, receivers  # v1 to a and b; v3 to a and c
    # v2's broadcast broke when b died (a lost it too) unless a's copy was complete before: a loaded v2 from the
    # object store exactly when the trainer says it did not reach a; c (not there yet) always did. (a may also
    # have caught v1 up: when its receiver already held v2 as it followed v1's signal, v1 came from the store.)
    assert (2 in received["a"]["caught_up"]) == (receivers[1] == 0), (receivers, received["a"]["caught_up"])
    assert 2 in received["c"]["caught_up"]
    assert 3 not in received["a"]["caught_up"] + received["c"]["caught_up"]  # v3 reached both by broadcast
    clients.close()


def test_short_batches_when_the_explorer_finished_steps_with_fewer_groups(run_config, tiny_model_dir, tmp_path):
    """Steps lost groups (failed tasks): once the explorer reports a step finished, the trainer trains the
    groups it has instead of waiting forever; once it reports done, an incomplete group is dropped, the rest
    trained, and the trainer stops."""
    from streamrft.explorer_state import ExplorerState

    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt"))
    clients = _clients(config)
    producer = clients.producer()

    def explorer_reports(finished_step: int, done: bool = False) -> None:
        state = ExplorerState(next_step=finished_step + 1, finished_step=finished_step, done=done)
        producer.produce(config.topic("control"), SyncSignal(kind=SyncKind.EXPLORER_STATE, version=state.next_step,
                                                          state=state.to_json()))
        producer.flush()

    produce(clients, config, make_group(0, 0))
    trainer = trainer_thread(config, clients)
    time.sleep(3)
    assert trainer.thread.is_alive() and trainer.role.step == 0  # nothing says step 0 is over yet
    explorer_reports(0)
    deadline = time.monotonic() + 30
    while trainer.role.step < 1:
        assert time.monotonic() < deadline and trainer.thread.is_alive()
        time.sleep(0.1)
    produce(clients, config, make_group(1, 0) + make_group(1, 1)[:3])
    explorer_reports(1, done=True)
    trainer.join(60)

    audit = Checkpoints(config.checkpoint_dir, 1).audit()
    assert [sorted(entry["eids"]) for entry in audit] == [[e.eid for e in make_group(0, 0)],
                                                          [e.eid for e in make_group(1, 0)]]
    metrics = read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=0.5)
    assert {m.step: m.value for m in metrics if m.name == "trainer/short_batch"} == {0: 1.0, 1: 1.0}
    assert {m.step: m.value for m in metrics if m.name == "trainer/dropped_incomplete"} == {0: 0.0, 1: 3.0}
    assert trainer.result == 2
    clients.close()


def test_fan_out_and_timestamp_replay_leave_the_main_group_alone(run_config, tiny_model_dir, tmp_path):
    # A replay lineage counts its own versions: recorded model_versions are the original lineage's, so give the
    # staleness bound room (a replay trainer reads a backlog, in whatever order partitions deliver it).
    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt", trainer={"total_steps": 2},
                                    sync={"max_staleness": 10}))
    clients = _clients(config)
    early, late = steps_of(0, 1), steps_of(2, 3)
    produce(clients, config, early)
    main = trainer_thread(config, clients)
    main.join(120)
    time.sleep(0.05)
    boundary_ms = int(time.time() * 1000)
    time.sleep(0.05)
    produce(clients, config, late)
    assert sorted(audit_eids(config.checkpoint_dir)) == sorted(e.eid for e in early)
    group, topic = config.consumer_group("trainer"), config.topic("experiences")
    deadline = time.monotonic() + 10
    while not (committed := clients.committed(group, topic)):
        assert time.monotonic() < deadline
        time.sleep(0.2)

    everything = config.model_copy(update={"trainer": config.trainer.model_copy(update={"total_steps": 4})})
    fan_out = trainer_thread(everything, clients, group="fanout", replay_from="earliest")
    replay = trainer_thread(config, clients, group="replay", replay_from=str(boundary_ms))
    fan_out.join(60)
    replay.join(60)

    root = config.checkpoint_dir
    assert sorted(audit_eids(root.with_name(root.name + "-fanout"))) == sorted(e.eid for e in early + late)
    assert sorted(audit_eids(root.with_name(root.name + "-replay"))) == sorted(e.eid for e in late)
    assert sorted(audit_eids(root)) == sorted(e.eid for e in early)  # the main lineage is untouched
    assert clients.committed(group, topic) == committed
    assert clients.committed(config.consumer_group("trainer-fanout"), topic)
    published = [s for s in read_all(config, clients.bootstrap, "sync", clients.serde, SyncSignal, idle=1)
                 if s.kind == SyncKind.WEIGHTS_PUBLISHED]
    assert [(s.version, s.source) for s in published] == [(1, "trainer"), (2, "trainer")]
    again = Trainer(config, clients, StopSignal(), group="fanout", replay_from="earliest")
    try:
        with pytest.raises(ConfigError, match="already holds checkpoints"):
            again.run()
    finally:
        again.close()
    clients.close()


def _run_the_loop(config, clients, *, tasks: int, seed: int) -> None:
    """Explorer, one fake-engine rollout worker and a live trainer on ``tasks`` arithmetic tasks, until the
    trainer and the explorer are done."""
    from streamrft.consumers.explorer import Explorer
    from streamrft.consumers.rollout import RolloutWorker
    from streamrft.engines.tasks import make_arithmetic_tasks

    from .roles import produce_tasks

    produce_tasks(clients, config, make_arithmetic_tasks(tasks, seed=seed))
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    trainer = trainer_thread(config, clients)
    try:
        wait_for(trainer, [worker, explorer], 240)
        wait_for(explorer, [worker], 60)
    finally:
        worker.stop.request()
        worker.join(60)


def test_trainer_driven_workers_move_only_to_the_versions_the_trainer_requests(run_config, tiny_model_dir,
                                                                                tmp_path):
    """trainer_driven: the trainer publishes every step but asks for a sync every second version; the explorer
    paces on those requests and its requests never name another version; no trained experience is staler
    than max_staleness."""
    from streamrft.schemas import RolloutRequest, RolloutResult

    steps = 6
    settings = _settings(tiny_model_dir, tmp_path / "ckpt",
                         explorer={"batch_size": 2, "repeat_times": 4, "max_steps": steps},
                         sync={"style": "trainer_driven", "interval": 1, "max_staleness": 2, "request_interval": 2},
                         trainer={"total_steps": steps, "save_interval": 100})
    settings["rollout"].update(engine="fake", fake_latency_s=0.05)
    config = run_config(**settings)
    clients = _clients(config)
    _run_the_loop(config, clients, tasks=steps * 2, seed=3)

    signals = read_all(config, clients.bootstrap, "sync", clients.serde, SyncSignal, idle=1)
    published = sorted(s.version for s in signals if s.kind == SyncKind.WEIGHTS_PUBLISHED)
    requested = sorted(s.version for s in signals if s.kind == SyncKind.SYNC_REQUEST)
    assert published == list(range(1, steps + 1)) and requested == [2, 4, 6]
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest, idle=1)
    wanted = {r.request_id: r.min_model_version for r in requests}
    assert set(wanted.values()) <= {0, 2, 4} and {2, 4} & set(wanted.values())  # paced on the requests only
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)
    assert all(r.model_version >= wanted[r.request_id] for r in results)
    staleness = [m.value for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=1)
                 if m.role == "trainer" and m.name == "trainer/staleness"]
    assert len(staleness) == steps and max(staleness) <= 2
    clients.close()


def test_fully_async_keeps_several_steps_in_flight_within_the_staleness_bound(run_config, tiny_model_dir,
                                                                               tmp_path):
    """fully_async with max_inflight_steps 3 and max_staleness 2 against a live trainer: the explorer runs
    ahead (its state record lists more than one step in flight), never publishes a step whose weights bound
    is unmet, every step is finished once and in order, and no trained experience is staler than 2."""
    from streamrft.schemas import RolloutRequest, RolloutResult
    from streamrft.explorer_state import ExplorerState

    steps = 6
    settings = _settings(tiny_model_dir, tmp_path / "ckpt",
                         explorer={"batch_size": 2, "repeat_times": 4, "max_steps": steps, "max_inflight_steps": 3},
                         sync={"style": "fully_async", "max_staleness": 2},
                         trainer={"total_steps": steps, "save_interval": 100})
    settings["rollout"].update(engine="fake", fake_latency_s=0.05)
    config = run_config(**settings)
    clients = _clients(config)
    _run_the_loop(config, clients, tasks=steps * 2, seed=4)

    signals = read_all(config, clients.bootstrap, "control", clients.serde, SyncSignal, idle=1)
    states = [ExplorerState.from_json(s.state) for s in signals if s.kind == SyncKind.EXPLORER_STATE]
    assert max(len(s.steps_in_flight) for s in states) > 1  # it ran ahead
    assert all(len(s.steps_in_flight) <= 3 for s in states)
    for state in states:  # in flight = the newest steps published, oldest first, none finished
        assert state.steps_in_flight == list(range(state.finished_step + 1, state.next_step))
    requests = read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest, idle=1)
    assert sorted(r.step for r in requests) == sorted(s for s in range(steps) for _ in range(2))
    assert all(r.min_model_version == max(0, r.step - 2) for r in requests)
    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)
    assert all(r.model_version >= max(0, r.step - 2) for r in results)
    metrics = read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=1)
    finished = [m.step for m in metrics if m.role == "explorer" and m.name == "time/step_s"]
    assert finished == list(range(steps))  # each step finished once, in order
    staleness = [m.value for m in metrics if m.role == "trainer" and m.name == "trainer/staleness"]
    assert len(staleness) == steps and max(staleness) <= 2
    clients.close()


def test_in_flight_weight_updates_make_experiences_that_span_versions_and_the_trainer_trains_each_once(
        run_config, tiny_model_dir, tmp_path):
    """``rollout.weight_update: in_flight`` through the loop (the simulated engine: one token per step for its
    batch, and every token's logprob that of its version): the trainer's weights land under running samples, so
    some experiences span two versions; each records its first and last version and where the newer one took
    over, its logprobs are those of the version of each token, staleness counts from the oldest, and the
    trainer trains every experience once with decoupled PPO (behaviour logprobs reweight, the clip is against
    the trainer's own weights)."""
    from streamrft.engines.inference.simulated import logprob_of

    steps = 4
    settings = _settings(tiny_model_dir, tmp_path / "ckpt",
                         explorer={"batch_size": 2, "repeat_times": 4, "max_steps": steps, "max_inflight_steps": 3},
                         sync={"style": "fully_async", "max_staleness": 2},
                         trainer={"total_steps": steps, "save_interval": 100,
                                  "algorithm": {"policy_loss": "decoupled_ppo", "recompute_old_logprobs": True}})
    # one step's 8 samples decode together; the next step's wait for room, so they run when v1 lands
    settings["rollout"].update(engine="simulated", simulated={"step_s": 0.04, "min_tokens": 30},
                               max_batch_size=8, weight_update="in_flight", sampling={"max_tokens": 60})
    config = run_config(**settings)
    clients = _clients(config)
    _run_the_loop(config, clients, tasks=steps * 2, seed=5)

    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
    spanning = [e for e in experiences if e.newest_version != e.model_version]
    assert spanning, "no experience spans two versions: the test did not exercise in-flight updates"
    for e in experiences:
        switches = [tuple(map(int, s.split(":"))) for s in e.info.get("version_switches", "").split(",") if s]
        versions, current = [], e.model_version
        for index in range(e.response_length):
            current = next((v for i, v in switches if i == index), current)
            versions.append(current)
        assert versions[-1] == e.newest_version
        assert list(e.logprob_array) == pytest.approx([logprob_of(v) for v in versions])
    audit = Checkpoints(tmp_path / "ckpt", 1).audit()
    trained = [eid for entry in audit for eid in entry["eids"]]
    assert sorted(trained) == sorted(e.eid for e in experiences)  # each once, the spanning ones too
    first_version = {e.eid: e.model_version for e in experiences}
    for entry in audit:  # staleness counted from each experience's oldest token, within the bound
        assert entry["staleness"] == [entry["step"] - first_version[eid] for eid in entry["eids"]]
        assert max(entry["staleness"]) <= 2
    metrics = read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=1)
    assert sum(m.value for m in metrics if m.name == "trainer/spanning_versions") == len(spanning)
    clients.close()
