"""Bench mode on the real broker with the tiny model: a trainer publishes v1 and v2, then `streamrft bench`
evaluates v0 (the base), v1 and v2 through a rollout worker in the bench namespace: one row per version, the
results served by that version, a CSV and a PNG."""
from __future__ import annotations

import csv
import hashlib
import json

import pytest
import yaml

from streamrft.cli import main
from streamrft.consumers.bench import bench_config, choose_versions
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus

from .roles import read_all
from .test_trainer_side import _clients, _settings, produce, steps_of, trainer_thread

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def test_choose_versions():
    assert choose_versions([1, 2, 3], "all") == [0, 1, 2, 3]
    assert choose_versions([1, 2, 3], "latest") == [0, 3]
    assert choose_versions([1, 2, 3], "3,1") == [1, 3]
    with pytest.raises(ValueError, match="keep_last"):
        choose_versions([2, 3], "1")


def test_bench_evaluates_the_base_and_each_published_version(run_config, tiny_model_dir, tmp_path):
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": i + 2}) + "\n"
                                 for i in range(3)))
    overrides = _settings(tiny_model_dir, tmp_path / "ckpt", trainer={"total_steps": 2},
                          explorer={"eval_tasksets": [{"name": "mini", "path": str(eval_file), "repeat_times": 2}]})
    config = run_config(**overrides)
    clients = _clients(config)
    produce(clients, config, steps_of(0, 1))
    trainer_thread(config, clients).join(180)

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"name": config.name, "kafka": {"bootstrap_servers":
                                                                   config.kafka.bootstrap_servers}, **overrides}))
    out = tmp_path / "bench"
    assert main(["bench", str(path), "--versions", "all", "--out", str(out), "--timeout-s", "300"]) == 0

    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["version"], r["taskset"]) for r in rows] == [("0", "mini"), ("1", "mini"), ("2", "mini")]
    assert all(float(r["tasks"]) == 3 and 0 <= float(r["mean@2"]) <= float(r["best@2"]) <= 1 for r in rows)
    assert (out / "bench.png").stat().st_size > 1000
    bench = bench_config(config)
    results = read_all(bench, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)
    served = {}
    for r in results:
        assert r.kind == RolloutKind.EVAL and r.status == RolloutStatus.OK
        served.setdefault(r.request_id.split("-v")[1].split("-")[0], set()).add(r.model_version)
    assert served == {"0": {0}, "1": {1}, "2": {2}}  # each version's requests ran on that version
    assert read_all(config, clients.bootstrap, "rollouts", clients.serde, RolloutRequest, idle=0.5) == []  # run untouched
    clients.close()


def test_bench_evaluates_checkpoints_the_object_store_no_longer_keeps(run_config, tiny_model_dir, tmp_path):
    """--checkpoints: the trainer checkpoints every step but its store keeps only the newest version; the bench
    publishes each checkpoint's weights to a store of its own and evaluates v0, v1 and v2 — and its v2 is
    tensor for tensor what the trainer published as v2."""
    import torch

    from streamrft.consumers.bench import published_versions
    from streamrft.engines.weights.object_store import MANIFEST_NAME, load_weights

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"question": f"What is {i} + 3?", "answer": i + 3}) + "\n"
                                 for i in range(2)))
    overrides = _settings(tiny_model_dir, tmp_path / "ckpt",
                          trainer={"total_steps": 2, "save_interval": 1, "keep_checkpoints": 3,
                                   "weights": {"keep_last": 1}},
                          explorer={"eval_tasksets": [{"name": "mini", "path": str(eval_file), "repeat_times": 2}]})
    config = run_config(**overrides)
    clients = _clients(config)
    produce(clients, config, steps_of(0, 1))
    trainer_thread(config, clients).join(180)
    _, in_store = published_versions(config, clients)
    assert sorted(in_store) == [2]  # v1 is gone from the run's store

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"name": config.name, "kafka": {"bootstrap_servers":
                                                                   config.kafka.bootstrap_servers}, **overrides}))
    out = tmp_path / "bench"
    assert main(["bench", str(path), "--checkpoints", str(config.checkpoint_dir), "--out", str(out),
                 "--timeout-s", "300"]) == 0
    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["version"] for r in rows] == ["0", "1", "2"] and all(float(r["tasks"]) == 2 for r in rows)
    results = read_all(bench_config(config), clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)
    assert {r.model_version for r in results if r.status == RolloutStatus.OK} == {0, 1, 2}
    manifests = sorted((out / "weights").glob(f"v*/{MANIFEST_NAME}"))
    assert [m.parent.name[:9] for m in manifests] == ["v00000001", "v00000002"]
    bench_v2 = load_weights(manifests[1].as_uri(), hashlib.sha256(manifests[1].read_bytes()).hexdigest())
    trainer_v2 = load_weights(*in_store[2])
    assert bench_v2.keys() == trainer_v2.keys()
    assert all(torch.equal(bench_v2[name], trainer_v2[name]) for name in trainer_v2)
    clients.close()
