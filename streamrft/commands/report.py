"""``streamrft report RUN_OR_CONFIG [--output PNG]``: one PNG of a run's learning curves, drawn from the
``metrics.csv`` the monitor writes. RUN_OR_CONFIG is a config file, a run's output directory, or a run name
(its directory comes from ``monitor.output_dir``, ``runs/<name>`` by default)."""
from __future__ import annotations

import argparse
import csv
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..config import load_config
from streamrft.consumers.monitor import METRICS_CSV
from ..errors import StreamrftError


REPORT_PNG = "report.png"

# (role, name) -> {step: value}; several sources of one role (rollout workers) are averaged per step.
Series = dict[tuple[str, str], dict[int, float]]


def register(subparsers) -> None:
    parser = subparsers.add_parser("report", help="plot a run's metrics (from the monitor's metrics.csv) to PNG")
    parser.add_argument("target", metavar="RUN_OR_CONFIG",
                        help="run name, run output directory, or run configuration file")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"PNG to write (default: <output_dir>/{REPORT_PNG})")
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    print(write_report(resolve_output_dir(args.target), args.output))
    return 0


def write_report(directory: Path, output: Path | None = None) -> Path:
    """The PNG of the monitor's metrics.csv in ``directory`` (default: ``directory/report.png``)."""
    return render(read_metrics(directory / METRICS_CSV), output or directory / REPORT_PNG, title=directory.name)


def resolve_output_dir(target: str) -> Path:
    """A directory as given; a file is a run configuration; anything else is a run name."""
    path = Path(target)
    if path.is_dir():
        return path
    if path.is_file():
        return load_config(path).output_dir
    if path.suffix in (".yaml", ".yml", ".json"):
        raise StreamrftError(f"{target}: no such configuration file")
    try:
        return load_config(overrides={"name": target}).output_dir
    except StreamrftError as exc:
        raise StreamrftError(f"{target!r} is neither a directory, a config file nor a valid run name: {exc}") \
            from exc


def read_metrics(path: Path) -> Series:
    if not path.is_file():
        raise StreamrftError(f"{path} does not exist; `streamrft monitor CONFIG` writes it while the run goes "
                             "(or point RUN_OR_CONFIG at the run's output directory)")
    sums: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with path.open(newline="") as f:
        for fields in csv.DictReader(f):
            try:
                key, step, value = (fields["role"], fields["name"]), int(fields["step"]), float(fields["value"])
            except (KeyError, TypeError, ValueError):
                continue  # a torn last line while the monitor writes
            if math.isfinite(value):
                sums[key][step].append(value)
    return {key: {step: sum(v) / len(v) for step, v in sorted(by_step.items())} for key, by_step in sums.items()}


@dataclass(frozen=True)
class Line:
    label: str
    points: dict[int, float]
    right: bool = False  # on the panel's second y axis


def _named(series: Series, name: str, role: str | None = None) -> dict[int, float]:
    """The series of ``name`` (from ``role``, or from the first role that has it, explorer first)."""
    roles = [role] if role else ["explorer", "trainer", "rollout"] + sorted({r for r, _ in series})
    for r in roles:
        if (r, name) in series:
            return series[(r, name)]
    return {}


def _ratio(num: dict[int, float], den: dict[int, float]) -> dict[int, float]:
    return {s: num[s] / den[s] for s in num if s in den and den[s] > 0}


def panels(series: Series) -> list[tuple[str, str, str, list[Line]]]:
    """(title, left y label, right y label, lines) for each panel; lines without points are left out."""
    reward = [Line("reward mean", _named(series, "rollout/reward_mean")),
              Line("accuracy", _named(series, "rollout/accuracy"))]
    reward += [Line(name, points) for (role, name), points in sorted(series.items())
               if name.startswith("eval/") and "/mean@" in name]
    losses = [Line(name.removeprefix("actor/"), points) for (role, name), points in sorted(series.items())
              if role == "trainer" and name.startswith("actor/") and "loss" in name and "kl" not in name]
    kl = [Line(name.removeprefix("actor/"), points) for (role, name), points in sorted(series.items())
          if role == "trainer" and name.startswith("actor/") and "kl" in name]
    staleness = [Line(f"{name} ({role})", points) for (role, name), points in sorted(series.items())
                 if "staleness" in name and not name.startswith("eval/")]
    step_s = _named(series, "time/step_s", "explorer")
    train_s = _named(series, "time/train_step", "trainer")
    throughput = [Line("explorer samples/s", _ratio(_named(series, "rollout/samples", "explorer"), step_s)),
                  Line("trainer samples/s", _ratio(_named(series, "actor/num_sequences", "trainer"), train_s)),
                  Line("explorer s/step", step_s, right=True),
                  Line("trainer s/step", train_s, right=True)]
    actor = [Line("entropy", _named(series, "actor/entropy", "trainer")),
             Line("grad norm", _named(series, "actor/grad_norm", "trainer"), right=True)]
    out = [("Reward & accuracy", "value", "", reward), ("Policy loss", "loss", "", losses),
           ("KL", "KL", "", kl), ("Staleness", "steps behind the weights", "", staleness),
           ("Throughput", "samples / s", "seconds / step", throughput),
           ("Entropy & grad norm", "entropy", "grad norm", actor)]
    return [(title, left, right, [line for line in lines if line.points]) for title, left, right, lines in out]


def render(series: Series, output: Path, title: str = "") -> Path:
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise StreamrftError("streamrft report needs matplotlib: pip install 'streamrft[monitor]'") from exc

    figure = Figure(figsize=(15, 8.5), layout="constrained")
    figure.suptitle(f"streamrft run {title}" if title else "streamrft run", fontsize=14)
    axes = figure.subplots(2, 3)
    for ax, (name, left_label, right_label, lines) in zip(axes.flat, panels(series)):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if not lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, fontsize=14,
                    color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.set_ylabel(left_label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        twin = ax.twinx() if any(line.right for line in lines) else None
        if twin is not None:
            twin.set_ylabel(right_label)
        handles = []
        for i, line in enumerate(lines):
            target = twin if line.right else ax
            steps = sorted(line.points)
            marker = "o" if len(steps) < 30 else None
            style = "--" if line.right else "-"
            handles += target.plot(steps, [line.points[s] for s in steps], style, marker=marker, markersize=3,
                                   color=f"C{i}", label=line.label)
        ax.legend(handles=handles, loc="best", fontsize=8)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    figure.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, output)
    return output
