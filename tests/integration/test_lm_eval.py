"""lm-evaluation-harness as a client of serve mode, with its default settings: ``local-completions`` in its
tokenized mode (token-id prompts; loglikelihood from echoed prompt logprobs) and ``local-chat-completions``, on
the small arithmetic tasks shipped in ``examples/lm_eval/`` (a local JSON file, no hub). lm-eval's figures must
be the engine's own: each choice's loglikelihood from a forward pass of the served model, and each greedy answer
from the engine directly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamrft.engines.inference import SamplingParams

from .test_serve import KEY, serve_config, serving

pytestmark = [pytest.mark.kafka, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "lm_eval"
DOCS = [json.loads(line) for line in (TASKS / "arith.jsonl").read_text().splitlines()]
MAX_GEN_TOKS = 8  # streamrft_arith_gen.yaml


@pytest.fixture
def evaluate(run_config, tiny_model_dir, tmp_path, monkeypatch):
    """simple_evaluate(model, model_args, tasks) against a server on the tiny model; yields it and the role."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: pip install -e '.[dev]'")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what lm-eval's API models send as the bearer token
    monkeypatch.chdir(ROOT)  # the tasks name their data file from the repository root
    config = serve_config(run_config, tiny_model_dir, tmp_path, serve={"max_tokens": MAX_GEN_TOKS})
    with serving(config) as (_clients, role, base, _client):
        manager = TaskManager(include_path=str(TASKS))

        def run(model: str, route: str, tasks: list[str], **extra) -> dict:
            args = f"model=tiny,base_url={base}/v1/{route},tokenizer={tiny_model_dir},max_length=1000"
            return lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=manager,
                                           log_samples=True, random_seed=0, numpy_random_seed=0,
                                           torch_random_seed=0, fewshot_random_seed=0, **extra)

        yield run, role


def loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, len(context):]
    return logprobs[len(context) - 1:].gather(-1, targets[:, None]).sum().item()


def greedy(engine, prompt) -> str:
    (completion,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=("\n",)))[0]
    return completion.text


def test_lm_eval_scores_are_the_engines_own(evaluate):
    run, role = evaluate
    engine = role.engine
    results = run("local-completions", "completions", ["streamrft_arith_mc", "streamrft_arith_gen"])
    samples = {task: sorted(rows, key=lambda r: r["doc_id"]) for task, rows in results["samples"].items()}

    correct = 0
    for row, doc in zip(samples["streamrft_arith_mc"], DOCS):
        context = engine.encode(doc["question"])
        # lm-eval's continuation is target_delimiter (" ", its default) + the choice
        expected = [loglikelihood(engine.model, context, engine.encode(" " + choice)) for choice in doc["choices"]]
        served = [ll for ll, _greedy in row["filtered_resps"]]
        assert served == pytest.approx(expected, abs=1e-4), doc["question"]
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["label"]
    accuracy = results["results"]["streamrft_arith_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(DOCS))

    answers = [row["filtered_resps"][0] for row in samples["streamrft_arith_gen"]]
    assert answers == [greedy(engine, engine.encode(doc["question"])) for doc in DOCS]
    exact = results["results"]["streamrft_arith_gen"]["exact_match,none"]
    assert exact == pytest.approx(sum(a == d["answer"] for a, d in zip(answers, DOCS)) / len(DOCS))
    print(f"\nlm-eval local-completions: streamrft_arith_mc acc {accuracy:.3f}, streamrft_arith_gen exact_match "
          f"{exact:.3f} over {len(DOCS)} docs each")

    chat = run("local-chat-completions", "chat/completions", ["streamrft_arith_gen"], apply_chat_template=True)
    rows = sorted(chat["samples"]["streamrft_arith_gen"], key=lambda r: r["doc_id"])
    assert [row["filtered_resps"][0] for row in rows] == [
        greedy(engine, [{"role": "user", "content": doc["question"]}]) for doc in DOCS]
    print(f"lm-eval local-chat-completions: streamrft_arith_gen exact_match "
          f"{chat['results']['streamrft_arith_gen']['exact_match,none']:.3f}")
