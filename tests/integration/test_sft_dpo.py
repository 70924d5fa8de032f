"""Supervised and preference data on the real broker with the tiny model: ``streamrft data produce`` (records,
masks, reference logprobs, rejects), the trainer's mix of SFT and DPO rows into RL batches (a second reader, its
shares, a stream running dry, the RL group's lag), mode train (where it stops, resume exactly once), and
an SFT warm-up that teaches the tiny model a format it did not follow."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from streamrft.commands.data import supervised_items
from streamrft.consumers.trainer.checkpoints import Checkpoints
from streamrft.consumers.trainer import Trainer
from streamrft.engines.models import build_tiny_tokenizer
from streamrft.kafka import KafkaClients
from streamrft.producers.chat_rows import ChatMapping
from streamrft.producers.task_producer import produce_records
from streamrft.schemas import Experience, Metric, Objective

from .roles import RoleThread, read_all
from .test_trainer_side import make_group, produce

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def _settings(tiny_model_dir, ckpt: Path, *, trainer: dict | None = None, explorer: dict | None = None,
              mode: str = "both") -> dict:
    return {
        "mode": mode,
        "model": {"path": str(tiny_model_dir)},
        "explorer": {"batch_size": 2, "repeat_times": 4, "metrics_port": None, **(explorer or {})},
        "rollout": {"sampling": {"max_tokens": 3}, "metrics_port": None},
        "trainer": {"checkpoint_dir": str(ckpt), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                    "micro_batch_size": 8, "save_interval": 100, **(trainer or {})},
    }


def _clients(config) -> KafkaClients:
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    return clients


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": f"={a + b}"}]}
            for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(n))]


def dpo_rows(n: int) -> list[dict]:
    return [{"prompt": f"{k}?", "chosen": f"yes {k}", "rejected": "no"} for k in range(n)]


def produce_data(config, clients, path: Path, objective: str, dataset: str) -> list[Experience]:
    """Produce a file as `streamrft data produce` does (the command's own pipeline); the experiences produced."""
    items = list(supervised_items(config, str(path), objective, ChatMapping(dataset=dataset)))
    summary = produce_records(clients.producer(), config.topic("experiences"), items)
    assert not summary.rejected, summary.rejected
    return [e for item in items for e in (item if isinstance(item, list) else [item])]


def trainer_thread(config, clients, **kwargs) -> RoleThread:
    return RoleThread("trainer", lambda stop: Trainer(config, clients, stop, **kwargs)).start()


def audit(root: Path) -> list[dict]:
    return Checkpoints(root, 1).audit()


def trainer_metrics(config, clients) -> dict[int, dict[str, float]]:
    """The trainer's metrics on the run's metrics topic, by step."""
    out: dict[int, dict[str, float]] = {}
    for metric in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric, idle=1):
        if metric.role == "trainer":
            out.setdefault(metric.step, {})[metric.name] = metric.value
    return out


# ------------------------------------------------------------------------------------------------- the mix
def test_mix_adds_its_share_of_sft_rows_and_dpo_pairs_to_each_rl_batch(run_config, tiny_model_dir, tmp_path):
    """8 RL rows a step and mix {sft: 0.2, dpo: 0.2}: 3 SFT rows and 1 DPO pair beside them (8 / 0.6 = 13.3 rows,
    20 % of it). The supervised records are on the topic before the RL ones, more SFT than 3 steps take and 2
    pairs for 3 steps, so the DPO stream runs dry at the third step and the batch goes on without it. The trainer
    stops after step 2 and a new one resumes from its checkpoint (both readers' positions and pools)."""
    ckpt = tmp_path / "ckpt"
    settings = _settings(tiny_model_dir, ckpt, trainer={"total_steps": 2, "mix": {"sft": 0.2, "dpo": 0.2}})
    config = run_config(**settings)
    clients = _clients(config)
    sft = produce_data(config, clients, _write_jsonl(tmp_path / "sft.jsonl", sft_rows(12)), "sft", "chat")
    dpo = produce_data(config, clients, _write_jsonl(tmp_path / "dpo.jsonl", dpo_rows(2)), "dpo", "prefs")
    rl = [e for step in range(3) for g in range(2) for e in make_group(step, g)]
    produce(clients, config, rl)

    first = trainer_thread(config, clients)
    first.join(120)
    assert first.result == 2
    state = json.loads((ckpt / "step-00000002" / "state.json").read_text())
    assert state["data_offsets"] and state["buffered"] > 0  # the data reader's positions and its pool
    settings["trainer"]["total_steps"] = 3
    resumed = trainer_thread(run_config(**{**settings, "name": config.name}), clients)
    resumed.join(120)
    assert resumed.result == 3

    steps = audit(ckpt)
    by_eid = {e.eid: e for e in sft + dpo + rl}
    objectives = [[by_eid[eid].objective for eid in entry["eids"]] for entry in steps]
    assert [o.count(Objective.RL) for o in objectives] == [8, 8, 8]
    assert [o.count(Objective.SFT) for o in objectives] == [3, 3, 3]
    assert [o.count(Objective.DPO) for o in objectives] == [2, 2, 0]  # a pair a step until the stream runs dry
    trained = [eid for entry in steps for eid in entry["eids"]]
    assert len(trained) == len(set(trained))
    # pairs trained whole, in the order produced
    assert [eid for eid in trained if by_eid[eid].objective == Objective.DPO] == [e.eid for e in dpo]

    metrics = trainer_metrics(config, clients)
    assert [metrics[s]["mix/sft_rows"] for s in range(3)] == [3.0, 3.0, 3.0]
    assert [metrics[s]["mix/dpo_missing"] for s in range(3)] == [0.0, 0.0, 1.0]
    assert [metrics[s]["dpo/num_pairs"] for s in (0, 1)] == [1.0, 1.0] and "dpo/loss" not in metrics[2]
    assert all(metrics[s]["actor/num_sequences"] == 8.0 for s in range(3))  # advantages saw the RL rows only
    assert metrics[0]["mix/sft_share"] == pytest.approx(3 / 13)

    # the RL group's committed offsets are the topic's end: the 3 SFT rows still untrained do not count as the
    # trainer's lag (which paces the explorer); the data reader's group holds them back
    topic = config.topic("experiences")
    ends = clients.offsets(topic, "end")
    assert clients.committed(config.consumer_group("trainer"), topic) == ends
    data_committed = clients.committed(config.consumer_group("trainer") + ".data", topic)
    untrained = {e.eid for e in sft} - set(trained)
    assert len(untrained) == 3 and sum(ends[tp] - data_committed.get(tp, 0) for tp in ends) >= 3
    clients.close()


# ------------------------------------------------------------------------------------------ data produce
def test_data_produce_writes_pairs_with_reference_logprobs_and_every_rejected_line(run_config, tiny_model_dir,
                                                                                    tmp_path):
    from transformers import AutoModelForCausalLM

    from streamrft.cli import main

    config = run_config(model={"path": str(tiny_model_dir)})
    clients = _clients(config)
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"},
            "{not json",
            {"prompt": "x", "chosen": "a"},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "assistant", "content": "go away"}]},
            {"prompt": "x", "chosen": "same", "rejected": "same"}]
    source = _write_jsonl(tmp_path / "prefs.jsonl", rows)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(json.dumps({"name": config.name, "model": {"path": str(tiny_model_dir)},
                                       "kafka": {"bootstrap_servers": config.kafka.bootstrap_servers}}))
    rejects = tmp_path / "rejects.jsonl"
    assert main(["data", "produce", str(source), "--as", "dpo", "-c", str(config_file), "--rejects",
                 str(rejects)]) == 1

    written = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["line"], r["reason"].split(":")[0]) for r in written] == [
        (2, "not valid JSON"), (3, "missing 'rejected' (set --chosen-key / --rejected-key)"),
        (5, "chosen and rejected are the same response")]
    assert written[1]["row"] == rows[2]  # the row as read, to fix and produce again

    records = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
    assert sorted(e.eid for e in records) == ["prefs-1/0", "prefs-1/1", "prefs-4/0", "prefs-4/1"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    tokenizer = build_tiny_tokenizer()
    for e in records:
        assert (e.objective, e.group_size, e.group_id) == (Objective.DPO, 2, e.eid.split("/")[0])
        with torch.no_grad():  # the reference: the initial model, teacher-forced, computed here on its own
            expected = token_logprobs(model, e)
        torch.testing.assert_close(torch.tensor(e.logprob_array), expected, rtol=1e-4, atol=1e-5)
        response = e.token_array[e.prompt_length:]
        trained = tokenizer.decode([t for t, m in zip(response, e.action_mask_array) if m], skip_special_tokens=False)
        side = {"prefs-1/0": "4", "prefs-1/1": "5", "prefs-4/0": "hello", "prefs-4/1": "go away"}[e.eid]
        assert trained == side + "<|im_end|>"
    by_eid = {e.eid: e for e in records}
    assert by_eid["prefs-4/0"].tokens[: 4 * by_eid["prefs-4/0"].prompt_length] == \
        by_eid["prefs-4/1"].tokens[: 4 * by_eid["prefs-4/1"].prompt_length]  # one prompt, two continuations
    clients.close()


def token_logprobs(model, exp: Experience) -> torch.Tensor:
    ids = torch.tensor(exp.token_array, dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0, exp.prompt_length - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, exp.prompt_length:, None])[:, 0]


# ------------------------------------------------------------------------------------------- mode train
def test_train_mode_trains_supervised_rows_alone_resumes_exactly_once_and_stops_at_the_data_end(
        run_config, tiny_model_dir, tmp_path):
    """10 SFT rows, an RL group, 4 DPO pairs on the topic; batches of whole groups in the order read (partitions
    interleave), each closed as soon as it holds 4 rows. The first trainer stops at total_steps 2 (a checkpoint
    with what it had read); the second resumes from it, with no total_steps: it trains the rest and stops on its
    own at the topic's end as it found it."""
    ckpt = tmp_path / "ckpt"
    settings = _settings(tiny_model_dir, ckpt, mode="train", trainer={"train_batch_size": 4})
    config = run_config(**{**settings, "trainer": {**settings["trainer"], "total_steps": 2}})
    clients = _clients(config)
    sft = produce_data(config, clients, _write_jsonl(tmp_path / "sft.jsonl", sft_rows(10)), "sft", "chat")
    rl = make_group(0, 0)
    produce(clients, config, rl)
    dpo = produce_data(config, clients, _write_jsonl(tmp_path / "dpo.jsonl", dpo_rows(4)), "dpo", "prefs")

    first = trainer_thread(config, clients)
    first.join(60)
    assert first.result == 2
    resumed = trainer_thread(run_config(**{**settings, "name": config.name}), clients)
    resumed.join(60)

    steps = audit(ckpt)
    assert resumed.result == len(steps) > 2
    trained = [eid for entry in steps for eid in entry["eids"]]
    assert sorted(trained) == sorted(e.eid for e in sft + dpo)  # each once; the RL group passed over
    pair_of = {e.eid: e.group_id for e in dpo}
    for entry in steps:
        rows = len(entry["eids"])
        last_group = 2 if entry["eids"][-1] in pair_of else 1
        assert rows - last_group < 4, entry  # closed as soon as it held 4 rows
        sides = [pair_of[eid] for eid in entry["eids"] if eid in pair_of]
        assert all(sides.count(group) == 2 for group in sides)  # a pair trains whole, in one step
    assert all(len(entry["eids"]) >= 4 for entry in steps[:-1]) and len(steps[-1]["eids"]) < 4 + 2
    metrics = trainer_metrics(config, clients)
    assert sum(m.get("dpo/num_pairs", 0) for m in metrics.values()) == 4
    assert max(m["trainer/passed_over"] for m in metrics.values()) == len(rl)
    assert [m["trainer/short_batch"] for _, m in sorted(metrics.items())][:-1] == [0.0] * (len(steps) - 1)
    clients.close()


def test_train_mode_refuses_to_start_on_an_empty_topic_without_total_steps(run_config, tiny_model_dir, tmp_path):
    from streamrft.errors import ConfigError

    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt", mode="train"))
    clients = _clients(config)
    trainer = trainer_thread(config, clients)
    with pytest.raises(ConfigError, match="is empty, and without trainer.total_steps"):
        trainer.join(60)
    clients.close()


# ------------------------------------------------------------------------------------------------ warm-up
@pytest.mark.slow
def test_an_sft_warm_up_with_streamrft_run_teaches_the_tiny_model_a_format(run_config, tiny_model_dir, tmp_path):
    """`streamrft run` in mode train: the launcher produces launch.data_files (512 conversations whose
    answers start with 'ANSWER '), starts the trainer and the monitor only, and the trainer stops at the data's
    end. The random tiny model never starts an answer that way; the published weights do on held-out prompts."""
    import subprocess
    import sys

    import yaml
    from transformers import AutoModelForCausalLM

    from streamrft.engines.weights.export import export_version

    rng = random.Random(1)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": f"ANSWER {a + b}"}]}
            for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(512))]
    data = _write_jsonl(tmp_path / "warmup.jsonl", rows)
    config = run_config()
    settings = {"name": config.name, "kafka": {"bootstrap_servers": config.kafka.bootstrap_servers},
                **_settings(tiny_model_dir, tmp_path / "ckpt", mode="train",
                            trainer={"train_batch_size": 16, "micro_batch_size": 16, "lr": 5e-3}),
                "monitor": {"output_dir": str(tmp_path / "run"), "metrics_port": None, "tensorboard": False},
                "launch": {"data_files": [{"path": str(data), "objective": "sft"}]}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("STREAMRFT_")}
    done = subprocess.run([sys.executable, "-m", "streamrft.cli", "run", str(tmp_path / "run.yaml"), "--no-dashboard"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["monitor.log", "trainer.log"]  # no explorer, no rollout worker
    assert len(audit(tmp_path / "ckpt")) == 32  # 512 rows / 16 a batch, then the data's end

    tokenizer = build_tiny_tokenizer()

    def follows(model) -> float:
        hits = 0
        for a, b in ((i, 2 * i + 3) for i in range(20)):  # prompts of the same kind, most not in the data
            ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{a}+{b}"}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
            out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            hits += tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).startswith("ANSWER ")
        return hits / 20

    before = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    exported = export_version(run_config(**settings).weights_url, 32, tiny_model_dir, tmp_path / "v32")
    after = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert follows(before) == 0.0
    assert follows(after) >= 0.9


def test_supervised_records_that_cannot_be_trained_are_dead_lettered_with_the_reason(run_config, tiny_model_dir,
                                                                                    tmp_path):
    """A DPO record that is no side of a pair fails its own check where it is read (validate); two records that
    each pass but are not one pair (two prompts) fail when their group is taken (process). Both are
    dead-lettered with the reason, once; the good SFT row beside them trains."""
    from dataclasses import replace

    from streamrft.kafka.reader import read_to_end
    from streamrft.schemas import pack_i32

    config = run_config(**_settings(tiny_model_dir, tmp_path / "ckpt", mode="train",
                                    trainer={"train_batch_size": 4}))
    clients = _clients(config)
    good = produce_data(config, clients, _write_jsonl(tmp_path / "sft.jsonl", sft_rows(1)), "sft", "chat")
    chosen, rejected = produce_data(config, clients, _write_jsonl(tmp_path / "dpo.jsonl", dpo_rows(1)), "dpo", "p")
    tokens = rejected.token_array.tolist()
    tokens[1] = tokens[1] + 1  # another prompt for the same pair
    other = replace(rejected, group_id="q-1", eid="q-1/1", tokens=pack_i32(tokens))
    unpaired = replace(chosen, group_id="r-1", eid="r-1/0", group_size=1)
    produce(clients, config, [replace(chosen, group_id="q-1", eid="q-1/0"), other, unpaired])

    trainer = trainer_thread(config, clients)
    trainer.join(60)
    trained = [eid for entry in audit(tmp_path / "ckpt") for eid in entry["eids"]]
    assert sorted(trained) == sorted(e.eid for e in good + [chosen, rejected])
    letters = sorted((raw.key.decode(), dict(raw.headers)["streamrft.reason"].decode(),
                      dict(raw.headers)["streamrft.stage"].decode())
                     for raw in read_to_end(config.kafka, clients.bootstrap, config.topic("experiences") + ".dlq"))
    assert letters == [("q-1", "bad-pair", "process"), ("q-1", "bad-pair", "process"), ("r-1", "bad-pair", "validate")]
    clients.close()
