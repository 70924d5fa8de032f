"""The live terminal view of ``streamrft run``: recent steps (reward, accuracy, weights version, staleness,
time), the trainer's latest figures, consumer-group lag, throughput and the role processes."""
from __future__ import annotations

import time
from collections import defaultdict

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from ..kafka import KafkaClients
from streamrft.schemas import Metric

ROWS = 12


class MetricsFollower:
    """Follows the run's ``metrics`` topic from the beginning (group-less) and keeps the values by step."""

    def __init__(self, clients: KafkaClients):
        topic = clients.config.topic("metrics")
        self._consumer = clients.consumer([topic], Metric, group=f"{clients.config.name}.dashboard",
                                          client_id="dashboard", subscribe=False, dead_letters=False)
        self._consumer.assign(clients.offsets(topic, "start"))
        self.by_role: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        self.latest: dict[str, float] = {}

    def poll(self) -> None:
        for item in self._consumer.poll(max_records=5000, timeout=0.05):
            metric = item.record
            self.by_role[metric.role][metric.step][metric.name] = metric.value
            self.latest[metric.name] = metric.value

    def close(self) -> None:
        self._consumer.close()


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def render(follower: MetricsFollower, lags: dict[str, int], processes: list, started: float, run: str):
    explorer = follower.by_role.get("explorer", {})
    trainer = follower.by_role.get("trainer", {})
    steps = Table(title="steps", expand=True)
    for column in ("step", "reward", "accuracy", "weights", "staleness", "ok/tasks", "s/step", "trainer loss",
                   "kl"):
        steps.add_column(column, justify="right")
    for step in sorted(explorer)[-ROWS:]:
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
    side.add_row("samples/s (worker)", _fmt(follower.latest.get("rollout_worker/samples_per_s"), ".1f"))
    side.add_row("trainer step", _fmt(max(trainer) if trainer else None, ".0f") if trainer else "-")
    side.add_row("grad norm", _fmt(follower.latest.get("actor/grad_norm"), ".3f"))
    side.add_row("lr", _fmt(follower.latest.get("actor/lr"), ".2e"))
    for group, lag in sorted(lags.items()):
        side.add_row(f"lag {group}", str(lag))
    for process in processes:
        state = "running" if process.running else f"exited {process.returncode}"
        side.add_row(process.name, state)
    elapsed = time.monotonic() - started
    return Panel(Group(steps, side), title=f"streamrft run {run} — {elapsed / 60:.1f} min",
                 subtitle="Ctrl-C stops every role and leaves a resumable run")


def group_lags(clients: KafkaClients) -> dict[str, int]:
    """Total lag of each of the run's consumer groups over the topics it reads."""
    lags: dict[str, int] = defaultdict(int)
    for report in clients.describe():
        for group, lag in report.groups.items():
            lags[group.removeprefix(f"{clients.config.name}.")] += lag
    return dict(lags)
