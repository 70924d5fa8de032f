"""On-policy distillation through the loop: does the student's reverse KL to its teacher fall?

The student and the teacher are the tiny model (``build_tiny_model``, seed 0) fine-tuned to answer "What is
a + b?" with "The answer is <a + b>.": the teacher for ``--teacher-sft`` steps, the student for only
``--student-sft`` (it has the format half right and the digits wrong). A random tiny student is no picture of
distillation: its samples are noise the teacher has no opinion on, and its reverse KL barely moves in 60 steps
(measured while building this). The run is ``streamrft run`` itself, on the embedded broker: explorer, one
rollout worker with the teacher as an auxiliary model (``distillation.teacher``: the teacher's logprobs of every
sampled token go into the experience) and a trainer with ``advantage: distill``, for ``--steps`` steps on
tasks a, b in [0, 50].

Measured: the exact per-token reverse KL, ``KL(π_student ‖ π_teacher)`` summed over the whole vocabulary at
each response position (``engines/workflows/teacher.py: reverse_kl``), on the student's own samples of 32
held-out prompts (a in 55..62, b in 70..73: numbers the training tasks never have), for the published weights of
every ``--every`` versions, from the run's object store.

    python bench/distillation.py --steps 40          # ~1.5 min on 2 CPU cores (63 s for the run)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ANSWER = "The answer is {}."
HELD_OUT = [(a, b) for a in range(55, 63) for b in range(70, 74)]


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def sft_tiny(path: Path, steps: int, seed: int, example=None, lr: float = 3e-3, batch: int = 16) -> Path:
    """The tiny model (seed 0) fine-tuned ``steps`` steps on ``example(rng) -> (chat messages, answer)`` (default:
    ``question(a, b)`` answered with ``ANSWER``, a, b in [0, 50]), the loss on the answer's tokens only; examples
    drawn with ``seed``. Saved to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrft.engines.models import build_tiny_model

    build_tiny_model(path, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    example = example or arithmetic_example
    model.train()
    for _ in range(steps):
        pairs = []
        for _ in range(batch):
            messages, answer = example(rng)
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            pairs.append((tokenizer.encode(prompt, add_special_tokens=False),
                          tokenizer.encode(answer + tokenizer.eos_token, add_special_tokens=False)))
        width = max(len(p) + len(r) for p, r in pairs)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100)
        attention = torch.zeros(batch, width, dtype=torch.long)
        for i, (p, r) in enumerate(pairs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            attention[i, : len(p) + len(r)] = 1
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    return path


def arithmetic_example(rng: random.Random) -> tuple[list[dict], str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return [{"role": "user", "content": question(a, b)}], ANSWER.format(a + b)


def student_and_teacher(root: Path, student_sft: int = 30, teacher_sft: int = 300) -> tuple[Path, Path]:
    return sft_tiny(root / "student", student_sft, seed=1), sft_tiny(root / "teacher", teacher_sft, seed=2)


def held_out_kl(student, teacher_model, samples: int = 1, max_tokens: int = 8, seed: int = 99) -> float:
    """The exact per-token reverse KL to ``teacher_model`` on ``student``'s own samples (a transformers engine,
    seeded) of the held-out prompts."""
    from streamrft.engines.inference import SamplingParams
    from streamrft.engines.workflows import reverse_kl

    prompts = [[{"role": "user", "content": question(a, b)}] for a, b in HELD_OUT]
    completions = [c for row in student.generate(prompts, SamplingParams(max_tokens=max_tokens, seed=seed),
                                                 n=samples) for c in row]
    return reverse_kl(student.model, teacher_model, [c.prompt_ids + c.response_ids for c in completions],
                      [len(c.prompt_ids) for c in completions])


def task_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"question": question(a, b), "answer": a + b}
            for a, b in ((rng.randint(0, 50), rng.randint(0, 50)) for _ in range(n))]


def run_config(root: Path, student: Path, teacher: Path, tasks: Path, steps: int, batch: int, lr: float) -> dict:
    return {
        "name": f"distill-{os.getpid()}",
        "model": {"path": str(student)},
        "auxiliary_models": {"teacher": {"engine": "transformers", "model": str(teacher)}},
        "distillation": {"teacher": "teacher"},
        "sync": {"style": "fixed", "interval": 1},
        "explorer": {"batch_size": batch, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
        "rollout": {"sampling": {"max_tokens": 8, "seed": 0}, "metrics_port": None},
        "trainer": {"lr": lr, "total_steps": steps, "micro_batch_size": 64, "save_interval": 1000,
                    "algorithm": {"advantage": "distill"}, "checkpoint_dir": str(root / "ckpt"),
                    "metrics_port": None, "weights": {"keep_last": steps + 1}},
        "monitor": {"output_dir": str(root / "out"), "tensorboard": False, "metrics_port": None},
        "launch": {"rollout_workers": 1, "task_files": [{"path": str(tasks), "workflow": "arithmetic"}]},
        "broker": {"data_dir": str(root / "kafka")},
    }


def published(weights_dir: Path) -> dict[int, dict]:
    """Every published version's tensors (manifests checked against their own bytes)."""
    from streamrft.engines.weights.object_store import load_weights

    out = {}
    for manifest in sorted(weights_dir.glob("v*/manifest.json")):
        body = manifest.read_bytes()
        version = json.loads(body)["version"]
        out[version] = load_weights(manifest.as_uri(), hashlib.sha256(body).hexdigest())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="measure every N versions")
    parser.add_argument("--batch", type=int, default=16, help="tasks per step (x 4 samples)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--student-sft", type=int, default=30)
    parser.add_argument("--teacher-sft", type=int, default=300)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from streamrft.engines.inference import create_engine

    root = Path(tempfile.mkdtemp(prefix="streamrft-distill-"))
    started = time.monotonic()
    student, teacher = student_and_teacher(root, args.student_sft, args.teacher_sft)
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in task_rows(args.batch * args.steps, seed=0)))
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(run_config(root, student, teacher, tasks, args.steps, args.batch, args.lr)))
    print(f"models ready in {time.monotonic() - started:.0f}s; streamrft run {config}", flush=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "streamrft.cli", "run", str(config), "--no-dashboard"], check=True,
                   stdout=subprocess.DEVNULL, stderr=open(root / "run.log", "w"))
    run_s = time.monotonic() - started

    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    engine = create_engine("transformers", student)
    versions = published(root / "weights")
    rows = [(0, held_out_kl(engine, teacher_model))]
    for version in sorted(v for v in versions if v % args.every == 0 or v == max(versions)):
        engine.load_weights(versions[version], version)
        rows.append((version, held_out_kl(engine, teacher_model)))
    print(f"{args.steps} steps of {args.batch} x 4 samples, lr {args.lr}, in {run_s:.0f}s ({root})")
    print("version  reverse KL to the teacher (nats/token, held-out prompts)")
    for version, kl in rows:
        print(f"{version:7d}  {kl:.3f}")


if __name__ == "__main__":
    main()
