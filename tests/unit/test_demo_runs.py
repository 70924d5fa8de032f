"""bench/demo_runs.py's bookkeeping (no run): the demo config it writes and what it reads back from a run's
metrics.csv."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from streamrft.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def demo_runs():
    sys.path.insert(0, str(BENCH))
    try:
        import demo_runs as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_the_config_is_the_demo_with_the_overrides_and_writes_only_under_the_run_dir(demo_runs, tmp_path):
    sft = {"path": "examples/data/arithmetic_sft.jsonl", "objective": "sft"}
    run = demo_runs.DemoRun("lr", {"trainer": {"lr": 3e-5}, "rollout": {"sampling": {"max_tokens": 32}},
                                   "launch": {"data_files": [sft]}})
    config = demo_runs.demo_config(run, tmp_path)
    path = tmp_path / "c.yaml"
    import yaml
    path.write_text(yaml.safe_dump(config))
    loaded = load_config(path, env={})
    assert loaded.trainer.lr == 3e-5 and loaded.rollout.sampling.max_tokens == 32
    assert loaded.rollout.sampling.temperature == 1.0  # the rest of the demo's sampling stays
    demo = load_config(demo_runs.DEMO_CONFIG, env={})
    assert (loaded.explorer.max_steps, loaded.explorer.eval_interval) == (demo.explorer.max_steps,
                                                                         demo.explorer.eval_interval)
    assert loaded.name.startswith("lr-") and str(loaded.output_dir).startswith(str(tmp_path))
    assert loaded.trainer.checkpoint_dir.startswith(str(tmp_path))
    assert loaded.explorer.metrics_port is None and loaded.rollout.metrics_port is None
    for data in (loaded.launch.data_files[0], loaded.launch.task_files[0]):  # found from any working directory
        assert Path(data.path).is_absolute() and Path(data.path).is_file()


def test_what_a_run_learned_is_read_from_its_metrics(demo_runs, tmp_path):
    rows = [("explorer", "rollout/accuracy", 0, 0.1), ("explorer", "rollout/accuracy", 1, 0.5),
            ("explorer", "rollout/accuracy", 2, 0.7), ("explorer", "eval/arith/mean@4", 1, 0.4),
            ("explorer", "eval/arith/mean@4", 2, 0.9), ("explorer", "eval/arith/best@4", 2, 1.0),
            ("trainer", "time/train_step", 0, 10.0), ("trainer", "time/train_step", 1, 14.0)]
    metrics = tmp_path / "metrics.csv"
    with metrics.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["role", "name", "step", "value", "created_at"])
        writer.writerows([(*row, 0) for row in rows])
    result = demo_runs.DemoResult("x", exit_code=0)
    demo_runs._read_metrics(metrics, result, ("time/train_step",))
    assert result.evals == {1: 0.4, 2: 0.9} and result.last_eval == 0.9  # best@4 is not mean@4
    assert result.accuracy_of_last(2) == pytest.approx(0.6)
    assert result.trainer_means == {"time/train_step": 12.0}
