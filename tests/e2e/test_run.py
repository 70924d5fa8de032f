"""`streamrft run` end to end: the real topology (broker, explorer, rollout worker, trainer, monitor as separate
processes) with a tiny model, checked through the topics and the files a user would look at."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from streamrft.config import load_config
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_topic
from streamrft.schemas import Experience, RolloutRequest, RolloutResult, RolloutStatus

pytestmark = [pytest.mark.kafka, pytest.mark.model, pytest.mark.slow]


def _write_run(tmp_path: Path, tiny_model_dir: Path, name: str, steps: int, tasks: int, security: str = "none") -> Path:
    rows = [{"question": f"What is {i % 7} + {i % 5}?", "answer": i % 7 + i % 5} for i in range(tasks)]
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "name": name,
        "model": {"path": str(tiny_model_dir)},
        "explorer": {"batch_size": 4, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
        "sync": {"style": "fixed", "interval": 1, "offset": 1, "max_staleness": 2},
        "rollout": {"sampling": {"max_tokens": 6}, "metrics_port": None},
        "trainer": {"lr": 1e-3, "micro_batch_size": 8, "save_interval": 1, "metrics_port": None,
                    "checkpoint_dir": str(tmp_path / "{name}" / "checkpoints")},
        "monitor": {"output_dir": str(tmp_path / "{name}"), "metrics_port": None, "tensorboard": False},
        "launch": {"rollout_workers": 1, "task_files": [{"path": str(task_file)}]},
        "topics": {"rollouts": {"partitions": 2}, "experiences": {"partitions": 2}},
        "broker": {"security": security},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _streamrft(*args: str, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")} | {"COLUMNS": "400"}
    return subprocess.Popen([sys.executable, "-m", "streamrft.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


def _read(config, bootstrap, name, record_type):
    topic = config.topic(name)
    serde = KafkaClients(config, bootstrap).serde
    return [serde.decode(r.value, topic, record_type) for r in read_topic(config.kafka, bootstrap, topic,
                                                                          idle_timeout=2)]


def _with_broker(config_path: Path, check):
    """Restart the run's kept broker data to inspect the topics after `streamrft run` exited."""
    from streamrft.broker import EmbeddedBroker

    config = load_config(config_path, env={})
    with EmbeddedBroker(config.broker, data_dir=config.output_dir / "kafka", keep_data=True) as broker:
        config = config.on_cluster(broker.bootstrap_servers, broker.security.admin if broker.security else None)
        check(config, broker.bootstrap_servers)


def test_streamrft_run_completes_a_short_run_with_a_principal_per_role(tmp_path, tiny_model_dir):
    """The broker runs with SASL/SCRAM and the StandardAuthorizer: each role connects as its own principal with
    only its ACLs, and the run completes that way (the resume test below runs without security)."""
    path = _write_run(tmp_path, tiny_model_dir, "e2e", steps=3, tasks=12, security="sasl_scram")
    proc = _streamrft("run", str(path), "--no-dashboard", cwd=tmp_path)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-5000:]

    run_dir = tmp_path / "e2e"
    assert "each role has its own principal" in output
    for role, log in (("explorer", "explorer"), ("trainer", "trainer"), ("monitor", "monitor"),
                      ("rollout", "rollout-0")):
        text = " ".join((run_dir / "logs" / f"{log}.log").read_text().split())
        assert f"as User:e2e.{role} (SASL_PLAINTEXT, SCRAM-SHA-512)" in text, (role, text[:3000])
    credentials = run_dir / "kafka" / "security" / "credentials"
    assert sorted(p.name for p in credentials.iterdir()) == sorted(
        f"e2e.{role}.json" for role in ("tasks", "explorer", "rollout", "trainer", "monitor", "serve", "viewer"))
    steps = (run_dir / "steps.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in steps[1:]] == ["0", "1", "2"]
    png = (run_dir / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    def check(config, bootstrap):
        requests = _read(config, bootstrap, "rollouts", RolloutRequest)
        results = _read(config, bootstrap, "results", RolloutResult)
        experiences = _read(config, bootstrap, "experiences", Experience)
        assert len(requests) == 12 and len({r.task.task_id for r in requests}) == 12
        assert len(results) == 12 and {r.status for r in results} == {RolloutStatus.OK}
        assert len(experiences) == 48 and len({e.eid for e in experiences}) == 48
        assert max(e.model_version for e in experiences) >= 1  # the trainer's weights reached the worker

    _with_broker(path, check)


def test_ctrl_c_then_resume_continues_without_repeating_tasks(tmp_path, tiny_model_dir):
    path = _write_run(tmp_path, tiny_model_dir, "resume", steps=6, tasks=24)
    proc = _streamrft("run", str(path), "--no-dashboard", cwd=tmp_path)
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # wait until step 1 is done, then Ctrl-C
        seen.append(line)
        if line.startswith("step 1:"):
            break
        assert time.monotonic() < deadline, "".join(seen)[-5000:]
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, ("".join(seen) + rest)[-5000:]

    resumed = _streamrft("run", str(path), "--no-dashboard", "--resume", cwd=tmp_path)
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-5000:]

    def check(config, bootstrap):
        requests = _read(config, bootstrap, "rollouts", RolloutRequest)
        per_task = Counter(r.task.task_id for r in requests)
        assert len(per_task) == 24 and set(per_task.values()) == {1}  # no task published twice
        assert sorted({r.step for r in requests}) == list(range(6))  # the step counter continued
        results = _read(config, bootstrap, "results", RolloutResult)
        assert Counter(r.request_id for r in results if r.status == RolloutStatus.OK).most_common(1)[0][1] == 1

    _with_broker(path, check)
