"""The demo with and without a 10 % SFT mix of correct worked answers: one `streamrft run` of each,
one after the other, and their evals after steps 9 and 19.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/sft_mix.py [--steps 20]

Sides: ``examples/arithmetic.yaml`` (GRPO) and ``examples/arithmetic_sft_mix.yaml`` (the same, plus
``trainer.mix: {sft: 0.1}`` over ``examples/data/arithmetic_sft.jsonl``: 340 sums, none in the eval taskset), each
with ``explorer.max_steps`` = ``--steps`` and its outputs under ``--workdir``. Printed per side: the wall clock, the
eval (mean@4, best@4 of the 32 eval tasks) after steps 9 and 19, the sampled accuracy of the first and last five
steps, and the SFT rows trained. One run per side: the demo samples unseeded, so read the difference with that in
mind.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
SIDES = {"grpo": "examples/arithmetic.yaml", "grpo + 10% sft": "examples/arithmetic_sft_mix.yaml"}
EVAL = "eval/arith"
console = Console()


@dataclass
class SideResult:
    side: str
    wall_s: float = 0.0
    exit_code: int | None = None
    evals: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (mean@4, best@4)
    accuracy: dict[int, float] = field(default_factory=dict)  # step -> sampled accuracy
    sft_rows: float = 0.0
    trainer_steps: int = 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="explorer steps per run (eval every 10)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/streamrft-bench-sft-mix"))
    parser.add_argument("--timeout-s", type=float, default=3600, help="a run still going after this is stopped")
    parser.add_argument("--sides", default=",".join(SIDES), help="which of: " + ", ".join(SIDES))
    parser.add_argument("--step-cost", action="store_true",
                        help="instead: time one demo trainer step with and without its 7 SFT rows, alternately")
    args = parser.parse_args()
    if args.step_cost:
        return step_cost()
    results = []
    for side in args.sides.split(","):
        console.print(f"[bold]{side}[/]: streamrft run {SIDES[side]}, {args.steps} steps")
        results.append(run_side(side, args))
        console.print(describe(results[-1]))
    show(results, args.steps)
    return 0 if all(r.exit_code == 0 for r in results) else 1


def run_side(side: str, args: argparse.Namespace) -> SideResult:
    side_dir = args.workdir / side.replace(" ", "").replace("%", "pct").replace("+", "-")
    shutil.rmtree(side_dir, ignore_errors=True)
    side_dir.mkdir(parents=True)
    config = yaml.safe_load((REPO / SIDES[side]).read_text())
    config["name"] = f"{config['name']}-{int(time.time())}"
    config["explorer"]["max_steps"] = args.steps
    config.setdefault("monitor", {})["output_dir"] = str(side_dir / "run")
    config["trainer"]["checkpoint_dir"] = str(side_dir / "checkpoints")
    config_path = side_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")}  # the config file rules
    result = SideResult(side)
    started = time.monotonic()
    with open(side_dir / "run.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "run", str(config_path), "--no-dashboard"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            result.exit_code = proc.wait(args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            result.exit_code = proc.wait(120)
    result.wall_s = time.monotonic() - started
    for heavy in ("checkpoints", "weights", "run/kafka"):  # GBs; the metrics and the log stay
        shutil.rmtree(side_dir / heavy, ignore_errors=True)
    read_metrics(result, side_dir / "run" / "metrics.csv")
    return result


def read_metrics(result: SideResult, path: Path) -> None:
    if not path.exists():
        return
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    means = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == f"{EVAL}/mean@4"}
    bests = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == f"{EVAL}/best@4"}
    result.evals = {step: (means[step], bests.get(step, float("nan"))) for step in sorted(means)}
    result.accuracy = {int(r["step"]): float(r["value"]) for r in rows
                       if r["role"] == "explorer" and r["name"] == "rollout/accuracy"}
    result.sft_rows = sum(float(r["value"]) for r in rows if r["name"] == "mix/sft_rows")
    result.trainer_steps = sum(1 for r in rows if r["role"] == "trainer" and r["name"] == "time/train_step")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def describe(r: SideResult) -> str:
    return (f"  exit {r.exit_code} in {r.wall_s / 60:.1f} min, {r.trainer_steps} trainer steps, evals "
            f"{ {s: tuple(round(v, 3) for v in e) for s, e in r.evals.items()} }, SFT rows {r.sft_rows:.0f}")


def show(results: list[SideResult], steps: int) -> None:
    table = Table(title=f"the demo, {steps} steps, one run each")
    for column in ("side", "wall clock", "trainer steps", "SFT rows", "eval after 9 (mean@4 / best@4)",
                   f"eval after {steps - 1}", "accuracy, first 5 steps", "accuracy, last 5 steps"):
        table.add_column(column)
    for r in results:
        acc = [r.accuracy[s] for s in sorted(r.accuracy)]
        evals = [f"{r.evals[s][0]:.3f} / {r.evals[s][1]:.3f}" if s in r.evals else "-" for s in (9, steps - 1)]
        table.add_row(r.side, f"{r.wall_s / 60:.1f} min", str(r.trainer_steps), f"{r.sft_rows:.0f}", *evals,
                      f"{_mean(acc[:5]):.3f}", f"{_mean(acc[-5:]):.3f}")
    console.print(table)


def step_cost(repeats: int = 3) -> int:
    """The demo trainer's step (64 RL rows: 8 groups of 8, 48-token responses; micro-batches of 16, no
    recomputed old logprobs) against the same step with the mix's 7 SFT rows, alternated on one engine."""
    import random
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrft.config import load_config
    from streamrft.model_paths import resolve_model_path
    from streamrft.engines.training import TrainingEngine
    from streamrft.producers.chat_rows import ChatMapping
    from streamrft.producers.supervised_data import read_sft
    from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32

    config = load_config(REPO / SIDES["grpo + 10% sft"], env={})
    model_dir = resolve_model_path(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    rl = []
    for g in range(8):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for k in range(8):
            response = [rng.randrange(100, 20000) for _ in range(48)]
            rl.append(Experience(eid=f"g{g}/{k}", group_id=f"g{g}", task_id=f"g{g}", step=0, kind=RolloutKind.TRAIN,
                                 run_index=k, group_size=8, model_version=0, tokens=pack_i32(list(prompt) + response),
                                 prompt_length=len(prompt), logprobs=pack_f32([-1.0] * 48), reward=float(k % 2)))
    sft = [e for e in read_sft(REPO / "examples/data/arithmetic_sft.jsonl", ChatMapping(dataset="sft"), tokenizer)][:7]
    engine = TrainingEngine(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                            config.training_settings, device="cpu")
    times: dict[str, list[float]] = {"64 RL rows": [], "64 RL rows + 7 SFT rows": []}
    for _ in range(repeats):
        for name, rows in (("64 RL rows", rl), ("64 RL rows + 7 SFT rows", rl + sft)):
            started = time.perf_counter()
            engine.train_step(rows)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["64 RL rows"])
    for name, values in times.items():
        median = statistics.median(values)
        console.print(f"{name}: median {median:.1f} s ({', '.join(f'{v:.1f}' for v in values)}), "
                      f"{median / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
