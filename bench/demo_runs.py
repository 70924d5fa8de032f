"""One `streamrft run` of the demo (examples/arithmetic.yaml) with some keys changed, and what it learned: the
shared part of the benches that compare recipes or algorithms on the demo task (demo_recipe.py, algorithms.py).

A run is the README's main job as a user runs it: its own broker, the explorer, the rollout worker, the trainer
and the monitor as processes, the demo's held-out eval set every ``explorer.eval_interval`` steps. Its wall time
is the command's, from launch to exit (imports, broker start and model loads included). What it learned comes
from the monitor's metrics.csv: the eval rounds' mean@k, the sampled accuracy of each step, and the mean of any
trainer metric asked for (clip and mask shares, step times)."""
from __future__ import annotations

import copy
import csv
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "examples" / "arithmetic.yaml"
STOP_GRACE_S = 120.0  # after the time cap: what a run gets to stop on SIGINT before it is killed


@dataclass(frozen=True)
class DemoRun:
    """The demo with ``overrides`` merged over examples/arithmetic.yaml (nested dicts merge, anything else
    replaces), stopped by SIGINT if it is still running after ``max_minutes``."""

    name: str
    overrides: dict[str, Any]
    max_minutes: float = 20.0


@dataclass
class DemoResult:
    name: str
    exit_code: int | None = None
    wall_s: float = 0.0
    evals: dict[int, float] = field(default_factory=dict)  # explorer step -> eval mean@k
    accuracy: dict[int, float] = field(default_factory=dict)  # explorer step -> sampled accuracy
    trainer_means: dict[str, float] = field(default_factory=dict)  # metric -> mean over the trainer's steps
    log: Path | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def last_eval(self) -> float | None:
        return self.evals[max(self.evals)] if self.evals else None

    def accuracy_of_last(self, n: int) -> float | None:
        steps = sorted(self.accuracy)[-n:]
        return sum(self.accuracy[s] for s in steps) / len(steps) if steps else None


def evals_by_step(result: DemoResult) -> str:
    """``step:mean`` of each eval round, for a table cell."""
    return " ".join(f"{step}:{value:.2f}" for step, value in sorted(result.evals.items())) or "-"


def fmt(value: float | None, digits: int = 2) -> str:
    """A table cell: ``-`` where a run did not get that far."""
    return "-" if value is None else f"{value:.{digits}f}"


def demo_config(run: DemoRun, out: Path) -> dict[str, Any]:
    """The demo config with ``run.overrides``, a unique name, and everything it writes under ``out``; no fixed
    metrics ports, so runs never collide with a user's."""
    config = merge(yaml.safe_load(DEMO_CONFIG.read_text()), run.overrides)
    config["name"] = f"{run.name}-{uuid.uuid4().hex[:6]}"
    config.setdefault("explorer", {})["metrics_port"] = None
    config.setdefault("rollout", {})["metrics_port"] = None
    config.setdefault("trainer", {}).update(checkpoint_dir=str(out / "checkpoints"), metrics_port=None)
    config["monitor"] = {**config.get("monitor", {}), "output_dir": str(out / "run"), "tensorboard": False,
                         "metrics_port": None}
    config["launch"] = {**config.get("launch", {}), "rollout_metrics_port_base": 0}
    for data in config["launch"].get("task_files", []) + config["launch"].get("data_files", []):
        data["path"] = str(REPO / data["path"])
    for taskset in config["explorer"].get("eval_tasksets", []):
        taskset["path"] = str(REPO / taskset["path"])
    return config


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def run_demo(run: DemoRun, workdir: Path, trainer_metrics: tuple[str, ...] = (), keep: bool = False) -> DemoResult:
    """Run ``run`` to its end (or its time cap) and read what it learned."""
    out = workdir / run.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(demo_config(run, out), sort_keys=False))
    result = DemoResult(run.name, log=out / "run.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")}  # the config file rules
    started = time.monotonic()
    with open(result.log, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "run", str(config_path), "--no-dashboard"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        result.exit_code = _wait(proc, started + run.max_minutes * 60)
    result.wall_s = time.monotonic() - started
    _read_metrics(out / "run" / "metrics.csv", result, trainer_metrics)
    if not keep:  # weights, checkpoints and broker data are GBs; the metrics and the log stay
        for heavy in (out / "checkpoints", out / "run" / "kafka", out / "run" / "weights"):
            shutil.rmtree(heavy, ignore_errors=True)
    return result


def _read_metrics(path: Path, result: DemoResult, trainer_metrics: tuple[str, ...]) -> None:
    if not path.exists():
        return
    sums: dict[str, list[float]] = {name: [] for name in trainer_metrics}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            role, name, step, value = row["role"], row["name"], int(row["step"]), float(row["value"])
            if role == "explorer" and name.startswith("eval/") and "/mean@" in name:
                result.evals[step] = value
            elif role == "explorer" and name == "rollout/accuracy":
                result.accuracy[step] = value
            elif role == "trainer" and name in sums:
                sums[name].append(value)
    result.trainer_means = {name: sum(v) / len(v) for name, v in sums.items() if v}


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    """Until ``proc`` exits or ``deadline`` (monotonic) passes; then SIGINT (the run's clean stop), then
    SIGKILL of its session after STOP_GRACE_S. Ctrl-C here stops it the same way."""
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        return proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait(STOP_GRACE_S)
        raise
