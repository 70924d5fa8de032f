"""The command line against the real broker: `tasks produce` accounts for every row, `topics` and `tail` show
what is there, and bad configuration stops a command with a message that says how to fix it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_topic
from streamrft.config import load_config

pytestmark = pytest.mark.kafka


def _cli(*args, env_extra=None, stdin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")} | (env_extra or {})
    return subprocess.run([sys.executable, "-m", "streamrft.cli", *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=300)


def test_tasks_produce_ten_thousand_rows_with_bad_ones(kafka_bootstrap, tmp_path):
    name = f"cli{uuid.uuid4().hex[:8]}"
    path = tmp_path / "tasks.jsonl"
    bad_lines = {}
    with path.open("w") as handle:
        for line in range(1, 10_001):
            if line % 250 == 0:
                handle.write("{not json\n")
                bad_lines[line] = "not valid JSON"
            elif line % 333 == 0:
                handle.write(json.dumps({"question": f"What is {line} + 1?"}) + "\n")
                bad_lines[line] = "missing 'answer'"
            else:
                handle.write(json.dumps({"id": f"task-{line}", "question": f"What is {line} + 1?",
                                         "answer": line + 1}) + "\n")
    env = {"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap, "STREAMRFT_NAME": name}
    rejects = tmp_path / "rejects.jsonl"
    done = _cli("tasks", "produce", str(path), "--id-key", "id", "--rejects", str(rejects), env_extra=env)
    assert done.returncode == 1, done.stderr[-3000:]  # some rows were rejected
    good = 10_000 - len(bad_lines)
    assert f"{good} task(s) produced" in done.stderr and f"{len(bad_lines)} row(s) rejected" in done.stderr
    for line in sorted(bad_lines)[:20]:  # the first 20 are listed, each with its line number and reason
        assert f"line {line}: {bad_lines[line]}" in done.stderr
    # ... and every one of them, with its row, is in the rejects file
    records = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [r["line"] for r in records] == sorted(bad_lines)
    assert all(r["reason"].startswith(bad_lines[r["line"]]) for r in records)
    assert all(r["row"] == "{not json" or r["row"]["question"] for r in records)
    assert f"{len(bad_lines)} rejected row(s) written" in done.stderr

    config = load_config(env=env)
    topic = config.topic("tasks")
    serde = KafkaClients(config, kafka_bootstrap).serde
    ids = [serde.decode(r.value, topic).task_id for r in read_topic(config.kafka, kafka_bootstrap, topic)]
    expected = [f"task-{line}" for line in range(1, 10_001) if line not in bad_lines]
    assert ids == expected  # exactly the good rows, once each, in file order

    topics = _cli("topics", env_extra=env)
    assert topics.returncode == 0 and f"rft.{name}.tasks" in topics.stdout and str(good) in topics.stdout
    tail = _cli("tail", "tasks", "--from-beginning", "-n", "2", env_extra=env)
    rows = [json.loads(line) for line in tail.stdout.splitlines()]
    assert [row["value"]["task_id"] for row in rows] == ["task-1", "task-2"]
    assert json.loads(rows[0]["value"]["payload"]) == {"question": "What is 1 + 1?", "answer": 2}


def test_stdin_is_a_task_source(kafka_bootstrap):
    env = {"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap, "STREAMRFT_NAME": f"cli{uuid.uuid4().hex[:8]}"}
    rows = "".join(json.dumps({"question": f"q{i}", "answer": i}) + "\n" for i in range(5))
    done = _cli("tasks", "produce", "-", env_extra=env, stdin=rows)
    assert done.returncode == 0 and "5 task(s) produced" in done.stderr


def test_bad_config_fails_at_start_and_says_how_to_fix_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: x\nexplorer:\n  batch_sise: 8\ntrainer:\n  train_batch_size: 10\n")
    done = _cli("topics", "-c", str(path))
    assert done.returncode == 2
    assert "explorer.batch_sise = 8: unknown key" in done.stderr
    assert "Traceback" not in done.stderr
    path.write_text("name: x\ntrainer:\n  train_batch_size: 10\n")
    done = _cli("topics", "-c", str(path))
    assert done.returncode == 2
    assert "train_batch_size (10) must be a multiple of explorer.repeat_times (4)" in done.stderr
