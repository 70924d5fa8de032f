"""`streamrft run` supervises its roles: each role process SIGKILLed mid-run in turn (a rollout worker, the
explorer, the trainer, the monitor) is started again (restart 1, shown on the launcher's output) and resumes (the
worker from its group's committed offsets, the explorer from its state record, the trainer from its checkpoint),
and the run finishes with every task's experiences present exactly once and nothing trained twice (the chaos
bench's checks, bench/chaos.py). The fake inference engine and a tiny model keep it short."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from streamrft.broker import EmbeddedBroker
from streamrft.config import load_config

from ..integration.chaos_harness import chaos_module

pytestmark = [pytest.mark.kafka, pytest.mark.model, pytest.mark.slow]

STEPS, BATCH, REPEAT = 8, 4, 4
# after which finished step each role is killed (the launcher prints "step N: ..." as steps finish)
KILLS = ((0, "rollout-0"), (2, "explorer"), (4, "train"), (5, "monitor"))


def _write_run(tmp_path: Path, tiny_model_dir: Path) -> Path:
    rows = [{"question": f"What is {i % 9} + {i % 7}?", "answer": i % 9 + i % 7} for i in range(STEPS * BATCH)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "name": "supervised",
        "model": {"path": str(tiny_model_dir)},
        "explorer": {"batch_size": BATCH, "repeat_times": REPEAT, "total_epochs": 1, "max_steps": STEPS,
                     "metrics_port": None},
        "sync": {"style": "fixed", "interval": 1, "offset": 1, "max_staleness": 2},
        "rollout": {"engine": "fake", "fake_latency_s": 0.2, "requests_per_batch": 2, "sampling": {"max_tokens": 6},
                    "metrics_port": None},
        "trainer": {"lr": 1e-3, "micro_batch_size": 8, "save_interval": 1, "device": "cpu", "metrics_port": None,
                    "checkpoint_dir": str(tmp_path / "checkpoints")},
        "monitor": {"output_dir": str(tmp_path / "run"), "metrics_port": None, "tensorboard": False},
        "launch": {"rollout_workers": 1, "task_files": [{"path": str(tmp_path / "tasks.jsonl")}],
                   "rollout_metrics_port_base": 0, "dashboard_refresh_s": 0.5,
                   "restart": {"max_restarts": 3, "backoff_s": 0.5, "backoff_max_s": 2}},
        "topics": {"rollouts": {"partitions": 2}, "experiences": {"partitions": 2}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _role_pid(launcher: int, word: str) -> int:
    """The pid of the launcher's child whose command line has ``word`` (a worker id, or the role's command)."""
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        if word.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no {word} process under the launcher (pid {launcher})")


def test_each_role_killed_mid_run_is_restarted_and_nothing_is_lost_or_doubled(tmp_path, tiny_model_dir):
    chaos = chaos_module()
    path = _write_run(tmp_path, tiny_model_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")} | {"COLUMNS": "400"}
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "run", str(path), "--no-dashboard"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    seen: list[str] = []
    lifetimes = []
    kills = list(KILLS)
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # each kill after its step has finished: every role is up and working by then
        seen.append(line)
        if kills and line.startswith(f"step {kills[0][0]}:"):
            _, word = kills.pop(0)
            os.kill(_role_pid(proc.pid, word), signal.SIGKILL)
            if word == "train":  # what this lifetime trained, before its successor truncates it to its checkpoint
                lifetimes.append(_trainer_lifetime(chaos, tmp_path / "checkpoints"))
        if not kills:
            break
        assert time.monotonic() < deadline, "".join(seen)[-5000:]
    rest, _ = proc.communicate(timeout=300)
    output = "".join(seen) + rest
    assert proc.returncode == 0, output[-5000:]
    for role in ("rollout-0", "explorer", "trainer", "monitor"):
        assert f"{role} killed by SIGKILL (-9); restarting it in 0.5s (restart 1" in output, output[-5000:]
        assert f"{role} restarted (restart 1, pid" in output, output[-5000:]
        log = (tmp_path / "run" / "logs" / f"{role}.log").read_text()
        assert log.count("restarted by streamrft run (restart 1) after a crash") == 1, role
    assert "restarts: explorer 1, monitor 1, rollout-0 1, trainer 1" in output, output[-5000:]

    config = load_config(path, env={})
    with EmbeddedBroker(config.broker, data_dir=config.output_dir / "kafka", keep_data=True) as broker:
        config = config.on_cluster(broker.bootstrap_servers, None)
        observed = chaos.observe_topics(config, broker.bootstrap_servers, tmp_path / "checkpoints")
    verdict = chaos.check(observed, lifetimes, STEPS)
    assert verdict.violations == {}, verdict.violations
    figures = verdict.figures
    assert figures["duplicates"] == 0 and figures["lost"] == 0
    assert figures["tasks"] == figures["requests"] == STEPS * BATCH
    assert figures["results OK"] == STEPS * BATCH and figures["experiences"] == STEPS * BATCH * REPEAT


def _trainer_lifetime(chaos, checkpoint_dir: Path):
    from streamrft.consumers.trainer.checkpoints import Checkpoints

    checkpoints = Checkpoints(checkpoint_dir, keep=1)
    steps = checkpoints.steps()
    return chaos.TrainerLifetime(1, "killed", checkpoints.audit(), steps[-1] if steps else -1)
