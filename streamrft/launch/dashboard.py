"""The live terminal view of ``streamrft run``: progress (steps done of the total, elapsed, ETA), recent steps
(reward, accuracy, weights version, staleness, time), the latest eval round per taskset, the sync style, the
trainer's latest figures, consumer-group lag, throughput and the role processes with their restarts."""
from __future__ import annotations

import time
from collections import defaultdict

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from ..kafka import KafkaClients
from streamrft.pacing import Pacing
from streamrft.schemas import Metric

from .supervision import describe_exit

ROWS = 12
# steps of each role kept for the view: the table shows ROWS, the ETA the last few; a run lasts days, so what
# accumulates over all steps (steps done, tasks per taskset, the newest eval round) is folded in as it arrives
KEEP_STEPS = 64


class MetricsHistory:
    """The run's metrics as the view needs them, in memory bounded whatever the run's length: each role's last
    KEEP_STEPS steps, the latest value of each name, and running figures over all steps (explorer steps
    finished, tasks per training taskset, the newest eval round per eval taskset)."""

    def __init__(self) -> None:
        self.by_role: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
        self.latest: dict[str, float] = {}
        self.steps_finished = 0  # explorer steps with their step time: finished (step -1 is the base model's eval)
        self.taskset_tasks: dict[str, float] = defaultdict(float)  # rollout/taskset/<name>/tasks, summed
        self.evals: dict[str, tuple[int, dict[str, float]]] = {}  # eval taskset -> (step, {"mean@4": ...})

    def add(self, role: str, step: int, name: str, value: float) -> None:
        steps = self.by_role[role]
        values = steps.setdefault(step, {})
        new = name not in values
        values[name] = value
        self.latest[name] = value
        if role == "explorer" and new:
            self._fold(step, name, value)
        if len(steps) > KEEP_STEPS:
            del steps[min(steps)]

    def _fold(self, step: int, name: str, value: float) -> None:
        if name == "time/step_s" and step >= 0:
            self.steps_finished += 1
        elif name.startswith("rollout/taskset/") and name.endswith("/tasks"):
            self.taskset_tasks[name[len("rollout/taskset/"):-len("/tasks")]] += value
        elif name.startswith("eval/") and "@" in name:
            _, taskset, what = name.split("/", 2)
            newest = self.evals.get(taskset)
            if newest is None or step > newest[0]:
                self.evals[taskset] = newest = (step, {})
            if step == newest[0]:
                newest[1][what] = value


class MetricsFollower(MetricsHistory):
    """Follows the run's ``metrics`` topic from the beginning (group-less) into a :class:`MetricsHistory`."""

    def __init__(self, clients: KafkaClients):
        super().__init__()
        topic = clients.config.topic("metrics")
        self._consumer = clients.consumer([topic], Metric, group=clients.config.consumer_group("dashboard"),
                                          client_id="dashboard", subscribe=False, dead_letters=False)
        self._consumer.assign(clients.offsets(topic, "start"))

    def poll(self) -> None:
        for item in self._consumer.poll(max_records=5000, timeout=0.05):
            metric = item.record
            self.add(metric.role, metric.step, metric.name, metric.value)

    def close(self) -> None:
        self._consumer.close()


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def progress(done: int, total: int | None, recent_step_s: list[float]) -> str:
    """``12/40 steps, ETA 7.5 min``: the ETA from the mean time of the recent steps (the steps' own metrics, so
    a resumed run's earlier steps do not distort it); none before the first step or without a total."""
    if total is None:
        return f"{done} steps"
    if not recent_step_s:
        return f"{done}/{total} steps"
    left = max(total - done, 0) * sum(recent_step_s) / len(recent_step_s)
    return f"{done}/{total} steps, ETA {left / 60:.1f} min"


def taskset_lines(history: MetricsHistory) -> dict[str, dict[str, float]]:
    """Per training taskset: tasks rolled out so far, and the newest step's accuracy and reward."""
    totals = {name: {"tasks": tasks} for name, tasks in history.taskset_tasks.items()}
    explorer = history.by_role.get("explorer", {})
    for step in sorted(explorer):
        for name, value in explorer[step].items():
            if name.startswith("rollout/taskset/") and not name.endswith("/tasks"):
                taskset, what = name[len("rollout/taskset/"):].rsplit("/", 1)
                totals.setdefault(taskset, {"tasks": 0.0})[what] = value
    return totals


def render(follower: MetricsHistory, lags: dict[str, int], processes: list, started: float, run: str, *,
           max_steps: int | None = None, sync: str = ""):
    """``sync``: a line saying what paces the explorer (``sync_line``)."""
    explorer = follower.by_role.get("explorer", {})
    trainer = follower.by_role.get("trainer", {})
    steps = Table(title="steps", expand=True)
    for column in ("step", "reward", "accuracy", "weights", "staleness", "ok/tasks", "s/step", "trainer loss",
                   "kl"):
        steps.add_column(column, justify="right")
    for step in [s for s in sorted(explorer) if s >= 0][-ROWS:]:  # (step -1: the base model's eval)
        row = explorer[step]
        train = trainer.get(step, {})  # trainer step t trains explorer step t's experiences
        steps.add_row(str(step), _fmt(row.get("rollout/reward_mean")), _fmt(row.get("rollout/accuracy")),
                      _fmt(row.get("rollout/model_version"), ".0f"), _fmt(row.get("rollout/staleness"), ".0f"),
                      f"{_fmt(row.get('rollout/ok'), '.0f')}/{_fmt(row.get('rollout/tasks'), '.0f')}",
                      _fmt(row.get("time/step_s"), ".1f"), _fmt(train.get("actor/pg_loss"), ".4f"),
                      _fmt(train.get("actor/kl"), ".4f"))
    side = Table.grid(padding=(0, 2))
    side.add_column(style="bold")
    side.add_column()
    # the pace is the time between finished steps: with several steps in flight a step's own time is longer
    step_times = [explorer[step].get("time/step_interval_s", explorer[step]["time/step_s"])
                  for step in sorted(explorer) if "time/step_s" in explorer[step]]
    side.add_row("progress", progress(follower.steps_finished, max_steps, step_times[-5:]))
    if sync:
        side.add_row("sync", sync)
    for taskset, values in taskset_lines(follower).items():
        side.add_row(f"taskset {taskset}", f"{values['tasks']:.0f} tasks, accuracy {_fmt(values.get('accuracy'))}, "
                                           f"reward {_fmt(values.get('reward_mean'))}")
    for taskset, (step, values) in sorted(follower.evals.items()):
        side.add_row(f"eval {taskset} ({'base model' if step < 0 else f'after step {step}'})",
                     ", ".join(f"{k} {v:.3f}" for k, v in sorted(values.items())))
    sampled = [explorer[step] for step in sorted(explorer) if "rollout/filtered_groups" in explorer[step]]
    if sampled:  # explorer.dynamic_sampling
        last = sampled[-1]
        side.add_row("dynamic sampling", f"last step {_fmt(last.get('rollout/informative_groups'), '.0f')} groups "
                                         f"trained, {_fmt(last['rollout/filtered_groups'], '.0f')} filtered, "
                                         f"{_fmt(last.get('rollout/oversample_rounds'), '.0f')} extra round(s)")
    if "rollout_worker/overlong_punished_frac" in follower.latest:  # rollout.overlong_penalty
        side.add_row("overlong (worker)", f"{follower.latest['rollout_worker/overlong_punished_frac']:.0%} punished, "
                                          f"mean {follower.latest['rollout_worker/overlong_penalty_mean']:.3f}")
    side.add_row("samples/s (worker)", _fmt(follower.latest.get("rollout_worker/samples_per_s"), ".1f"))
    side.add_row("trainer step", _fmt(max(trainer) if trainer else None, ".0f") if trainer else "-")
    side.add_row("grad norm", _fmt(follower.latest.get("actor/grad_norm"), ".3f"))
    side.add_row("lr", _fmt(follower.latest.get("actor/lr"), ".2e"))
    for group, lag in sorted(lags.items()):
        side.add_row(f"lag {group}", f"{lag} records")
    for process in processes:
        side.add_row(process.name, role_state(process))
    elapsed = time.monotonic() - started
    return Panel(Group(steps, side), title=f"streamrft run {run} — {elapsed / 60:.1f} min",
                 subtitle="Ctrl-C stops every role and leaves a resumable run")


def role_state(process, now: float | None = None) -> str:
    """``running, restarts: 1``; ``killed by SIGKILL (-9), restarting in 2s, restarts: 1``; ``exited 0, ...``."""
    waiting = getattr(process, "restart_at", None)
    if process.running:
        state = "running"
    elif waiting is not None:
        left = max(waiting - (time.monotonic() if now is None else now), 0)
        state = f"{describe_exit(process.returncode)}, restarting in {left:.0f}s"
    else:
        state = f"exited {process.returncode}"
    return f"{state}, restarts: {getattr(process, 'restarts', 0)}"


def sync_line(config, state=None) -> str:
    """What paces the explorer, in a few words (``config``: the run config), and, given the explorer's state
    record, the steps in flight and what the next one waits for."""
    line = f"{Pacing.of(config).describe()}, up to {config.explorer.max_inflight_steps} step(s) in flight"
    if state is None:
        return line
    flying = state.steps_in_flight
    line += f"\nin flight: {', '.join(map(str, flying)) if flying else 'none'}"
    if state.waiting:
        line += f"; step {state.next_step} waits for {state.waiting}"
    return line


def group_lags(clients: KafkaClients) -> dict[str, int]:
    """Total lag of each of the run's consumer groups over the topics it reads, in records (transaction markers
    are no lag: ``streamrft/kafka/records_lag.py``)."""
    lags: dict[str, int] = defaultdict(int)
    for report in clients.describe():
        for group, lag in report.groups.items():
            lags[group.removeprefix(f"{clients.config.name}.")] += lag
    return dict(lags)
