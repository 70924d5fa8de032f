"""Each algorithm family on the demo task for the same budget, with GRPO beside it: one `streamrft run` of the
README's main job (examples/arithmetic.yaml, "What is a + b?" with SmolLM2-135M-Instruct) per family, the family's
keys changed and nothing else, every run stopped after the same number of explorer steps.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/algorithms.py [--families grpo,cispo,...]
                                        [--max-steps 24] [--eval-interval 8] [--max-minutes 20] [--workdir DIR]

Printed per family: the paper or source of its recipe, the run's exit code and wall time (launch to exit), the
explorer steps it finished, eval mean@4 on the held-out examples/data/arithmetic_eval.jsonl after the last step
and after every ``--eval-interval`` steps, the sampled accuracy of the last 5 steps, the trainer's mean clip share
and mask share where the family reports one (the metric behind each cell is listed under the table), its mean
train step time, and its ratio to GRPO's last eval and step time. GRPO (the demo as it is) always runs first:
the ratios are to the GRPO run of the same session, never to a figure from another day.

Time: each run is a whole demo of ``--max-steps`` steps, about 8-15 minutes on the 2-core VM with vLLM (PPO with
a critic, decoupled PPO, DAPO and ReMax do more work per step), so all 16 families take about 3 hours; a run still
going after ``--max-minutes`` is stopped. One run per family, sampled unseeded, on a 32-task eval: differences of
less than about 0.1 in eval mean@4 are within the noise. This is a bench, not a test: nothing here is asserted;
tests/unit/test_algorithms_bench.py checks only that every family's config loads."""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from demo_runs import REPO, DemoResult, DemoRun, evals_by_step, fmt, merge, run_demo

console = Console(width=None if sys.stdout.isatty() else 260)  # a log file gets the whole table, not 80 columns

BASELINE = "grpo"
STEP_TIME = "time/train_step"
PG_CLIP = "actor/pg_clipfrac"


@dataclass(frozen=True)
class Family:
    """A recipe as ``overrides`` over examples/arithmetic.yaml; ``clip``, ``mask`` and ``own``: the trainer metrics
    (streamrft/metric_catalog/topic_metrics.py) shown as its clip share, mask share and one more of its own."""

    paper: str
    overrides: dict[str, Any]
    clip: str | None = PG_CLIP
    mask: str | None = None
    own: str | None = None


def _algorithm(**keys: Any) -> dict[str, Any]:
    return {"trainer": {"algorithm": keys}}


def _dapo() -> dict[str, Any]:
    """examples/dapo.yaml's DAPO keys, read from the file so the bench runs the recipe the example ships."""
    dapo = yaml.safe_load((REPO / "examples" / "dapo.yaml").read_text())
    return {"explorer": {"dynamic_sampling": dapo["explorer"]["dynamic_sampling"]},
            "rollout": {"overlong_penalty": dapo["rollout"]["overlong_penalty"]},
            "trainer": {"algorithm": dapo["trainer"]["algorithm"]}}


# The demo already trains with token-mean aggregation and clip-higher (0.2 / 0.28) and without KL: a family changes
# only what its paper changes over that.
FAMILIES: dict[str, Family] = {
    "grpo": Family("Shao et al. 2024 (DeepSeekMath); the demo as it is", {}),
    # token-mean already has no per-response length normaliser, the other half of Dr. GRPO
    "dr_grpo": Family("Liu et al. 2025 (Dr. GRPO): no std scaling", _algorithm(advantage="dr_grpo")),
    "rloo": Family("Ahmadian et al. 2024 (RLOO)", _algorithm(advantage="rloo")),
    "reinforce_plus_plus": Family("Hu 2025 (REINFORCE++): batch-whitened returns, no KL reward",
                                  _algorithm(advantage="reinforce_plus_plus")),
    "remax": Family("Li et al. 2023 (ReMax): greedy baseline, one more sample per task",
                    _algorithm(advantage="remax")),
    # the paper's ratio is to the training engine's own likelihoods: against the sampler's (the demo's
    # recompute_old_logprobs: false) the bf16/fp32 mismatch alone would leave its 3e-4 / 4e-4 band on nearly every
    # sequence. With one update a batch the recomputed logprobs come from the training pass itself, at no cost.
    "gspo": Family("Zheng et al. 2025 (GSPO): sequence ratio, clip 3e-4 / 4e-4",
                   _algorithm(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean",
                              recompute_old_logprobs=True)),
    "cispo": Family("MiniMax 2025 (MiniMax-M1 CISPO)", _algorithm(policy_loss="cispo", clip_low=1.0, clip_high=0.28),
                    clip="actor/cispo_clip_frac"),
    "sapo": Family("Gao et al. 2025, arXiv:2511.20347 (SAPO)",
                   _algorithm(policy_loss="sapo", policy_loss_params={"tau_pos": 1.0, "tau_neg": 1.05},
                              loss_agg="seq-mean-token-mean"),
                   clip=None, own="actor/sapo_gate_mean"),
    "topr": Family("Le Roux et al. 2025, arXiv:2503.14286 (TOPR)",
                   _algorithm(policy_loss="topr", policy_loss_params={"threshold": 0.0}),
                   clip="actor/topr_tapered_frac"),
    "opmd": Family("Yao et al. 2025, arXiv:2509.24203; Trinity-RFT opmd",
                   _algorithm(advantage="opmd", advantage_params={"baseline": "logavgexp", "tau": 1.0},
                              policy_loss="opmd", policy_loss_params={"tau": 1.0}),
                   clip=None),
    "dual_clip": Family("Ye et al. 2020 Eq. 5 (dual-clip PPO, c = 3)", _algorithm(clip_ratio_c=3.0),
                        own="actor/pg_clipfrac_lower"),
    "dapo": Family("Yu et al. 2025, arXiv:2503.14476 (DAPO; examples/dapo.yaml)", _dapo()),
    "ppo_gae": Family("Schulman et al. 2017 + GAE 2016: PPO with a critic (γ 1, λ 0.95)",
                      _algorithm(advantage="gae", gae_gamma=1.0, gae_lambda=0.95),
                      own="critic/value_explained_var"),
    # decoupled PPO clips against the trainer's current weights, so it needs the recomputed logprobs
    "decoupled_ppo": Family("Fu et al. 2025 (AReaL) + geometric-mean MIS (band 0.5-2)",
                            _algorithm(policy_loss="decoupled_ppo", recompute_old_logprobs=True,
                                       is_correction="geo_mis"),
                            mask="actor/is_seq_masked_frac"),
    # a horizon of 1,000 samples lets the coefficient move by up to ~1.3 % a step (64 samples), so it visibly
    # adapts within the bench's steps; veRL's 10,000 would hold it nearly fixed
    "adaptive_kl": Family("Ziegler et al. 2019 §2.2 (adaptive KL reward penalty)",
                          _algorithm(kl_penalty_coef=0.001, kl_ctrl="adaptive", target_kl=0.05, kl_horizon=1000),
                          own="actor/kl_coef"),
    # the demo's own SFT data (340 worked sums, none in the eval set), 10 % of the rows as in
    # examples/arithmetic_sft_mix.yaml; μ decays over the default budget of 24 steps. It learns from expert
    # answers the other families never see.
    "chord": Family("Zhang et al. 2025, arXiv:2508.11408 (CHORD-φ over a 10 % SFT mix)",
                    {"trainer": {"mix": {"sft": 0.1},
                                 "algorithm": {"mix_weighting": "chord", "sft_loss": "sft_phi", "chord_mu_peak": 0.5,
                                               "chord_mu_valley": 0.02, "chord_mu_warmup_steps": 0,
                                               "chord_mu_decay_steps": 24}},
                     "launch": {"data_files": [{"path": "examples/data/arithmetic_sft.jsonl", "objective": "sft"}]}},
                    own="mix/chord_mu"),
}


def family_run(name: str, max_steps: int, eval_interval: int, max_minutes: float) -> DemoRun:
    """The demo with family ``name``'s keys, for the bench's budget (the same for every family)."""
    budget = {"explorer": {"max_steps": max_steps, "eval_interval": eval_interval}}
    return DemoRun(name, merge(FAMILIES[name].overrides, budget), max_minutes)


def trainer_metrics() -> tuple[str, ...]:
    """Every trainer metric some family's row shows, and the step time."""
    names = [STEP_TIME] + [m for f in FAMILIES.values() for m in (f.clip, f.mask, f.own) if m]
    return tuple(dict.fromkeys(names))


def chosen(families: str) -> list[str]:
    """The families of ``--families``, GRPO first (added if missing: the ratios need it)."""
    names = [name.strip() for name in families.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; choose from "
                         f"{', '.join(FAMILIES)}")
    return [BASELINE] + [name for name in dict.fromkeys(names) if name != BASELINE]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated, of: {', '.join(FAMILIES)} (grpo always runs, first)")
    parser.add_argument("--max-steps", type=int, default=24, help="explorer steps of every run")
    parser.add_argument("--eval-interval", type=int, default=8,
                        help="eval after every this many steps; must divide --max-steps (an eval at the end)")
    parser.add_argument("--max-minutes", type=float, default=20.0, help="a run still going then is stopped")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    try:
        names = chosen(args.families)
    except ValueError as e:
        parser.error(str(e))
    if args.max_steps < 1 or args.eval_interval < 1 or args.max_steps % args.eval_interval:
        parser.error(f"--eval-interval {args.eval_interval} must divide --max-steps {args.max_steps} (both >= 1), "
                     "so that every family is evaluated after its last step")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="algorithms-"))
    results = []
    for name in names:
        run = family_run(name, args.max_steps, args.eval_interval, args.max_minutes)
        console.print(f"[bold]{name}[/]: {FAMILIES[name].overrides or 'examples/arithmetic.yaml as it is'} "
                      f"(log under {workdir / name})")
        result = run_demo(run, workdir, trainer_metrics())
        console.print(f"  exit {result.exit_code} after {result.wall_s / 60:.1f} min; evals {evals_by_step(result)}")
        results.append(result)
        if len(results) < len(names):  # the table so far: a bench stopped early still has its rows
            console.print(table(results, args.max_steps))
    console.print(table(results, args.max_steps))
    console.print(legend([r.name for r in results]))
    return 0 if all(r.ok for r in results) else 1


def table(results: list[DemoResult], max_steps: int) -> Table:
    """One row per family; the ratios are to the GRPO row (the first) of the same results."""
    base = next((r for r in results if r.name == BASELINE), None)
    out = Table(title=f"algorithm families on the demo task, {max_steps} steps each, one `streamrft run` each")
    for column in ("family", "paper", "exit", "wall min", "steps", "eval mean@4", "eval by step", "accuracy last 5",
                   "clip share", "mask share", "own metric", "train step s", "eval / GRPO", "step s / GRPO"):
        out.add_column(column, justify="left" if column in ("family", "paper") else "right")
    for r in results:
        family = FAMILIES[r.name]
        step = r.trainer_means.get(STEP_TIME)
        out.add_row(r.name, family.paper, str(r.exit_code), f"{r.wall_s / 60:.1f}", str(len(r.accuracy)),
                    fmt(r.last_eval), evals_by_step(r), fmt(r.accuracy_of_last(5)), _metric(r, family.clip),
                    _metric(r, family.mask), _metric(r, family.own), fmt(step, 1),
                    fmt(_ratio(r.last_eval, base.last_eval if base else None)),
                    fmt(_ratio(step, base.trainer_means.get(STEP_TIME) if base else None)))
    return out


def legend(names: list[str]) -> str:
    """Which trainer metric each family's clip, mask and own cells are (means over its trainer steps)."""
    lines = ["clip / mask / own metric cells: the mean over the run's trainer steps of"]
    for name in names:
        family = FAMILIES[name]
        cells = [f"{label} {metric}" for label, metric in (("clip", family.clip), ("mask", family.mask),
                                                           ("own", family.own)) if metric]
        lines.append(f"  {name}: {', '.join(cells) or 'none'}")
    return "\n".join(lines)


def _metric(result: DemoResult, name: str | None) -> str:
    return fmt(result.trainer_means.get(name), 3) if name else ""


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


if __name__ == "__main__":
    raise SystemExit(main())
