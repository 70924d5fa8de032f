"""Which demo recipe learns fastest: a small sweep of the keys that set the demo's pace and its learning (learning
rate, group size, batch, response length, staleness), each a whole `streamrft run` of the README's main job.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/demo_recipe.py [--recipes demo,lr2e-5,...]
                                                                        [--max-minutes 16] [--workdir DIR]

Printed per recipe: the command's wall time (launch to exit), the steps the explorer finished, eval mean@4 after
each evaluation (the held-out examples/data/arithmetic_eval.jsonl), the sampled accuracy of the last 5 steps and
the trainer's mean step time and clip share; the first row is the recipe examples/arithmetic.yaml has now (the
baseline of the same session). The goal: the last evaluation at mean@4 >= 0.9 with the run itself under 12
minutes on this machine. The runs go one after the other; a machine shared with other work makes them slower
and noisier (run it alone)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from demo_runs import DemoResult, DemoRun, evals_by_step, fmt, merge, run_demo

console = Console()

# what each recipe changes in examples/arithmetic.yaml; "demo" is the file as it is
BF16_ROLLOUT = {"model": {"dtype": "bfloat16"}, "rollout": {"vllm": {"enforce_eager": True}}}
RECIPES: dict[str, dict] = {
    "demo": {},
    "bf16-rollout": BF16_ROLLOUT,
    "bf16-lr3e-5-tokens32-32steps": merge(BF16_ROLLOUT, {
        "trainer": {"lr": 3.0e-5}, "rollout": {"sampling": {"max_tokens": 32}},
        "explorer": {"max_steps": 32, "eval_interval": 8}}),
    "bf16-lr5e-5-tokens32-24steps": merge(BF16_ROLLOUT, {
        "trainer": {"lr": 5.0e-5}, "rollout": {"sampling": {"max_tokens": 32}},
        "explorer": {"max_steps": 24, "eval_interval": 8}}),
    "bf16-lr3e-5-32steps": merge(BF16_ROLLOUT, {
        "trainer": {"lr": 3.0e-5}, "explorer": {"max_steps": 32, "eval_interval": 8}}),
    "bf16-lr3e-5-group4x16-32steps": merge(BF16_ROLLOUT, {
        "trainer": {"lr": 3.0e-5}, "explorer": {"batch_size": 16, "repeat_times": 4, "max_steps": 32,
                                                "eval_interval": 8},
        "rollout": {"requests_per_batch": 16}}),
}
TRAINER_METRICS = ("time/train_step", "actor/pg_clipfrac")
GOAL_EVAL, GOAL_MINUTES = 0.9, 12.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="bf16-lr3e-5-tokens32-32steps,bf16-lr5e-5-tokens32-24steps,bf16-rollout",
                        help=f"comma-separated, of: {', '.join(RECIPES)}")
    parser.add_argument("--max-minutes", type=float, default=16.0, help="a run still going then is stopped")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    names = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = [name for name in names if name not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="demo-recipe-"))
    results = []
    for name in names:
        console.print(f"[bold]{name}[/]: {RECIPES[name] or 'examples/arithmetic.yaml as it is'} "
                      f"(log under {workdir / name})")
        result = run_demo(DemoRun(name, RECIPES[name], args.max_minutes), workdir, TRAINER_METRICS)
        console.print(f"  exit {result.exit_code} after {result.wall_s / 60:.1f} min; evals {evals_by_step(result)}")
        results.append(result)
    console.width = max(console.width, 160)  # one line per recipe, also when piped
    console.print(table(results))
    return 0 if all(r.ok for r in results) else 1


def table(results: list[DemoResult]) -> Table:
    out = Table(title=f"demo recipes, one `streamrft run` each (goal: last eval mean@4 >= {GOAL_EVAL} in under "
                      f"{GOAL_MINUTES:.0f} min)")
    for column in ("recipe", "exit", "wall min", "steps", "eval mean@4 by step", "last eval", "accuracy last 5",
                   "train step s", "clip share", "goal"):
        out.add_column(column, justify="right")
    for r in results:
        met = r.ok and r.last_eval is not None and r.last_eval >= GOAL_EVAL and r.wall_s < GOAL_MINUTES * 60
        last5 = r.accuracy_of_last(5)
        out.add_row(r.name, str(r.exit_code), f"{r.wall_s / 60:.1f}", str(len(r.accuracy)), evals_by_step(r),
                    fmt(r.last_eval), fmt(last5), fmt(r.trainer_means.get("time/train_step"), 1),
                    fmt(r.trainer_means.get("actor/pg_clipfrac"), 3), "met" if met else "not met")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
