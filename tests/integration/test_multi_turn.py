"""Multi-turn episodes through the whole loop on the real broker: guess_number and the calculator tool, rolled out
by a worker on a tiny real model, trained by the trainer on the model's tokens only; a worker SIGKILLed in the
middle of an episode leaves nothing of it, and the episode is redone whole by another worker."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrft.consumers.trainer.checkpoints import Checkpoints
from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.consumers.trainer import Trainer
from streamrft.engines.models import build_tiny_tokenizer
from streamrft.engines.tasks import make_word_problems
from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience, Metric, RolloutResult, RolloutStatus, Task

from ..unit.test_episodes import spans
from .roles import RoleThread, produce_tasks, read_all, role_process, wait_for, write_config
from .tool_model import build_tool_model

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def _clients(config) -> KafkaClients:
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    return clients


def _settings(model_dir: Path, ckpt: Path, steps: int, **limits) -> dict:
    return {
        "model": {"path": str(model_dir)},
        "explorer": {"batch_size": 4, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
        "sync": {"style": "fixed", "interval": 1},
        "rollout": {"sampling": {"max_tokens": 110, "temperature": 1.0, "seed": 0}, "metrics_port": None},
        "limits": limits,
        "trainer": {"checkpoint_dir": str(ckpt), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                    "micro_batch_size": 16, "total_steps": steps, "save_interval": 100},
    }


def _guess_tasks(n: int, max_turns: int = 3) -> list[Task]:
    return [Task(task_id=f"guess-{i}", workflow="guess_number", taskset="guess",
                 payload=json.dumps({"target": 10 + i, "low": 1, "high": 99, "max_turns": max_turns}))
            for i in range(n)]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory) -> Path:
    return build_tool_model(tmp_path_factory.mktemp("tool-model"))


def test_guess_number_and_calculator_episodes_train_through_the_loop(run_config, tool_model_dir, tmp_path):
    """Two steps of mixed tasks (guess_number and calculator) through explorer -> worker -> trainer. Checked:
    the episodes really are multi-turn (tool results and game replies inserted), every model turn is a span of
    action-mask ones and every environment turn a span of zeros, and the tokens each trainer step trained
    (``actor/num_tokens``) are exactly the model tokens of the experiences its audit lists."""
    steps = 2
    config = run_config(**_settings(tool_model_dir, tmp_path / "ckpt", steps, max_turns=3, max_episode_tokens=300))
    clients = _clients(config)
    tasks = [t for pair in zip(make_word_problems(4, seed=1), _guess_tasks(4)) for t in pair]  # 2 of each a step
    produce_tasks(clients, config, tasks)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    trainer = RoleThread("trainer", lambda stop: Trainer(config, clients, stop)).start()
    try:
        wait_for(trainer, [worker, explorer], 300)
        wait_for(explorer, [worker], 60)
    finally:
        for role in (worker, explorer, trainer):
            role.stop.request()
        worker.join(60)
    assert trainer.result == steps

    experiences = {e.eid: e for e in read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)}
    eos = build_tiny_tokenizer().eos_token_id
    inserted_roles = Counter()
    for e in experiences.values():
        mask = e.action_mask_array.tolist()
        response = e.token_array[e.prompt_length:].tolist()
        model_turns = spans(mask)
        assert len(model_turns) == e.metrics["turns"] and mask[-1] == 1, e.eid  # ends on the model's turn
        assert sum(mask) == e.metrics["model_tokens"]
        for start, end in model_turns[:-1]:  # every turn but the last one ended by EOS or max_tokens
            assert response[end - 1] == eos or e.metrics["turns_cut"] > 0
        assert all(lp == 0.0 for lp, m in zip(e.logprob_array.tolist(), mask) if not m)
        text = e.response_text
        inserted_roles.update(line.split(":")[0] for line in text.splitlines() if line.startswith(("tool:", "user:")))
    assert inserted_roles["tool"] > 0 and inserted_roles["user"] > 0, inserted_roles  # tool results, game replies
    calculator = [e for e in experiences.values() if e.task_id.startswith("word_problems")]
    assert any(e.metrics["tool_calls"] > 0 and e.metrics["turns"] >= 2 for e in calculator)

    trained_tokens = {m.step: m.value for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
                      if m.role == "trainer" and m.name == "actor/num_tokens"}
    audit = Checkpoints(config.checkpoint_dir, 1).audit()
    assert [entry["step"] for entry in audit] == list(range(steps))
    for entry in audit:
        assert len(entry["eids"]) == 16
        model_tokens = sum(int(experiences[eid].action_mask_array.sum()) for eid in entry["eids"])
        assert trained_tokens[entry["step"]] == model_tokens, entry["step"]
    clients.close()


SLOW_PLUGIN = '''
import os, time
from streamrft.engines.workflows.guess_number import GuessNumber

class SlowGuess(GuessNumber):
    """guess_number that takes its time over each reply and leaves a mark of each: <target>-<pid>-<turn>."""

    def step(self, text):
        open(os.path.join(os.environ["SLOW_GUESS_MARKS"], f"{self.target}-{os.getpid()}-{self.guesses}"), "w").close()
        time.sleep(0.4)
        return super().step(text)
'''


def _install_plugin(root: Path) -> Path:
    """An installed distribution (a module and its .dist-info) registering ``slow_guess`` by entry point."""
    root.mkdir(parents=True)
    (root / "slow_guess_plugin.py").write_text(SLOW_PLUGIN)
    info = root / "slow_guess_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slow-guess-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[streamrft.environments]\nslow_guess = slow_guess_plugin:SlowGuess\n")
    return root


def test_a_worker_killed_mid_episode_leaves_nothing_and_the_episode_is_redone_whole(run_config, tiny_model_dir,
                                                                                     tmp_path):
    """The victim worker is SIGKILLed after the environment answered a turn of an episode (a plugin environment,
    found by entry point in the worker processes). Its request is redone by the survivor: one OK result, every
    episode of its group complete (the game's end), the group trained exactly once."""
    steps = 2
    settings = _settings(tiny_model_dir, tmp_path / "ckpt", steps)
    settings["explorer"].update(batch_size=2, repeat_times=2)
    settings["rollout"].update(requests_per_batch=1, transaction_timeout_ms=10_000, sampling={"max_tokens": 4})
    config = run_config(**settings)
    clients = _clients(config)
    produce_tasks(clients, config, [Task(task_id=f"slow-{i}", workflow="slow_guess", taskset="slow",
                                         payload=json.dumps({"target": 50 + i, "max_turns": 4}))
                                    for i in range(2 * steps)])
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(_install_plugin(tmp_path / "plugin")), *sys.path]),
           "SLOW_GUESS_MARKS": str(marks)}
    path = write_config(config, tmp_path / "run.yaml")
    victim = role_process(["rollout", "--worker-id", "victim"], path, tmp_path / "victim.log", **env)
    survivor = None
    deadline = time.monotonic() + 120
    while "assigned" not in (tmp_path / "victim.log").read_text():  # alone in the group: every request is its
        assert time.monotonic() < deadline and victim.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
        time.sleep(0.2)
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    trainer = RoleThread("trainer", lambda stop: Trainer(config, clients, stop)).start()
    try:
        deadline = time.monotonic() + 120
        while not list(marks.glob(f"*-{victim.pid}-1")):  # an episode's second model turn was answered
            assert time.monotonic() < deadline and victim.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        interrupted = {int(p.name.split("-")[0]) for p in marks.glob(f"*-{victim.pid}-*")}
        assert interrupted
        survivor = role_process(["rollout", "--worker-id", "survivor"], path, tmp_path / "survivor.log", **env)
        wait_for(trainer, [explorer], 300)
        wait_for(explorer, [], 60)
    finally:
        explorer.stop.request()
        trainer.stop.request()
        if survivor is not None:
            survivor.send_signal(signal.SIGTERM)
            assert survivor.wait(60) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
        victim.wait(10)
    assert victim.returncode == -signal.SIGKILL and trainer.result == steps

    results = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)
    assert sorted(r.task_id for r in results) == [f"slow-{i}" for i in range(2 * steps)]  # each once
    assert {r.status for r in results} == {RolloutStatus.OK}
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert Counter(e.eid for e in experiences).most_common(1)[0][1] == 1 and len(experiences) == 4 * steps
    by_target = {50 + i: f"slow-{i}" for i in range(2 * steps)}
    for target in interrupted:  # what the victim was in the middle of: redone whole by the survivor
        group = [e for e in experiences if e.task_id == by_target[target]]
        assert group and {e.worker_id for e in group} == {"survivor"}, by_target[target]
        for e in group:
            assert e.info["finish"] == "done" and (e.metrics["turns"] == 4 or e.info["found"] == "true")
    audit = [eid for entry in Checkpoints(config.checkpoint_dir, 1).audit() for eid in entry["eids"]]
    assert sorted(audit) == sorted(e.eid for e in experiences)  # every episode trained once, none in part
    clients.close()
