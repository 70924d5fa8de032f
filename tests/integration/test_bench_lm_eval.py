"""`streamrft bench --lm-eval` on the real broker with the tiny model: a version published to the run's store is
benched through a rollout worker and, with lm-eval's ``streamrft_arith_mc`` (examples/lm_eval, a few documents),
through a server of each version; the CSV's lm-eval column of each version is that version's own accuracy, scored
here by a forward pass of the tiny model with that version's weights, and the lm-eval server wrote nothing."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from streamrft.cli import main
from streamrft.engines.weights.locations import new_lineage
from streamrft.engines.weights.object_store import ObjectStore
from streamrft.schemas import Experience, FeedbackReceipt, SyncKind, SyncMethod, SyncSignal

from .roles import read_all
from .test_trainer_side import _clients, _settings

pytestmark = [pytest.mark.kafka, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
TASK = "streamrft_arith_mc"
LIMIT = 4
DOCS = [json.loads(line) for line in (ROOT / "examples" / "lm_eval" / "arith.jsonl").read_text().splitlines()][:LIMIT]
COLUMN = f"lm_eval/{TASK}/acc"


def accuracy(model, tokenizer) -> float:
    """lm-eval's ``acc`` of ``model`` on the first LIMIT documents: the choice whose continuation (target
    delimiter " " + choice, tokenized as the whole text less the question) is likeliest is the label."""
    correct = 0
    for doc in DOCS:
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        scores = []
        for choice in doc["choices"]:
            ids = torch.tensor([tokenizer.encode(f"{doc['question']} {choice}", add_special_tokens=False)])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            scores.append(logprobs[len(context) - 1:].gather(-1, ids[0, len(context):, None]).sum().item())
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return correct / len(DOCS)


def other_weights(model, tokenizer) -> tuple[dict[str, torch.Tensor], float, float]:
    """Weights near the model's whose accuracy differs from its own (so the column tells the versions apart):
    (the weights, the base accuracy, theirs)."""
    base = {name: p.detach().clone() for name, p in model.named_parameters()}  # tied embeddings once
    v0 = accuracy(model, tokenizer)
    for seed in range(20):
        noise = torch.Generator().manual_seed(seed)
        weights = {name: t + 0.05 * torch.randn(t.shape, generator=noise) for name, t in base.items()}
        model.load_state_dict(weights, strict=False)
        if (v1 := accuracy(model, tokenizer)) != v0:
            return weights, v0, v1
    raise AssertionError("no perturbation of the tiny model changes its accuracy")


def test_bench_reports_lm_eval_tasks_per_version(run_config, tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: pip install -e '.[dev]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrft.consumers.bench_lm_eval import lm_eval_config

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the task names its data file from the repository root
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"question": "What is 1 + 2?", "answer": 3}) + "\n")
    overrides = _settings(tiny_model_dir, tmp_path / "ckpt",
                          explorer={"eval_tasksets": [{"name": "mini", "path": str(eval_file), "repeat_times": 1}]})
    config = run_config(**overrides)
    clients = _clients(config)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    v1_weights, v0_accuracy, v1_accuracy = other_weights(model, tokenizer)
    lineage = new_lineage()
    published = ObjectStore(config.weights_url, lineage=lineage).publish(v1_weights.items(), version=1)
    producer = clients.producer()  # as the trainer announces it on the run's sync
    producer.produce(config.topic("sync"), SyncSignal(
        kind=SyncKind.WEIGHTS_PUBLISHED, version=1, method=SyncMethod.OBJECT_STORE, uri=published.uri,
        sha256=published.sha256, nbytes=published.nbytes, lineage=lineage))
    producer.flush()

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"name": config.name, "kafka": {"bootstrap_servers":
                                                                   config.kafka.bootstrap_servers}, **overrides}))
    out = tmp_path / "bench"
    assert main(["bench", str(path), "--versions", "all", "--out", str(out), "--timeout-s", "120",
                 "--lm-eval", TASK, "--lm-eval-include", "examples/lm_eval", "--lm-eval-limit", str(LIMIT)]) == 0

    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["version"], r["taskset"]) for r in rows] == [("0", "mini"), ("1", "mini")]
    assert all(float(r["tasks"]) == 1 for r in rows)  # the rollout workers' bench ran too
    assert [float(r[COLUMN]) for r in rows] == pytest.approx([v0_accuracy, v1_accuracy])
    assert f"{COLUMN}_stderr" in rows[0]

    served = lm_eval_config(config, "unused")  # the lm-eval server's namespace: nothing written there
    for topic, record in (("sync", SyncSignal), ("experiences", Experience), ("feedback", FeedbackReceipt)):
        assert read_all(served, clients.bootstrap, topic, clients.serde, record, idle=0.5) == [], topic
    clients.close()
