"""The monitor: reads the run's ``metrics`` topic and exports it.

Outputs, all derived from the same de-duplicated table (one value per ``(source, name, step)``, last delivery
wins, so a record delivered twice never adds a row or a point):

- Prometheus, on ``monitor.metrics_port``: a gauge per metric name (``rollout/reward_mean`` ->
  ``streamrft_rollout_reward_mean``) labelled ``role`` and ``source``, holding the value of the latest step,
  and ``streamrft_metric_step{metric, role, source}`` holding that step; and the run's consumer groups' lag in
  records, ``streamrft_consumer_group_lag_records{group, topic}`` (``lag_gauges.py``: what KEDA scales on);
- the experiment trackers of ``monitor.trackers`` (:mod:`.trackers`): TensorBoard event files under
  ``<output_dir>/tensorboard``, an MLflow run, an offline W&B run; each gets every value, the run's config and
  the eval table;
- ``<output_dir>/metrics.csv``, long form (step, role, source, name, value, created_at), and
  ``<output_dir>/steps.csv``, wide form: one row per step with the explorer's ``rollout/*``, ``time/*`` and
  ``eval/*`` values and the trainer's ``actor/*`` and ``trainer/*`` values for that step.

The loop, as numbered steps (``handle``, then the unit's commit): 1. poll and decode (undecodable records go to
the DLQ); 2. export each new or changed value; 3. flush the files; 4. commit the offsets. A crash between 3 and 4
redelivers records the files already hold; the table, reloaded from ``metrics.csv`` at start, skips them.
"""
from __future__ import annotations

import csv
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from streamrft.config import RunConfig
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.runtime import RoleRuntime
from streamrft.schemas import Metric

from .lag_gauges import GroupLagGauges
from .trackers import eval_table, open_trackers

logger = logging.getLogger(__name__)

POLL_S = 0.5
MAX_RECORDS = 1000
METRICS_CSV = "metrics.csv"
STEPS_CSV = "steps.csv"
LONG_COLUMNS = ("step", "role", "source", "name", "value", "created_at")
# Which metrics become columns of steps.csv: role -> name prefixes.
STEP_COLUMNS: dict[str, tuple[str, ...]] = {"explorer": ("rollout/", "time/", "eval/"),
                                             "trainer": ("actor/", "trainer/", "sft/", "dpo/", "mix/",
                                                         "distill/")}
PROMETHEUS_PREFIX = "streamrft_"
STEP_GAUGE = "streamrft_metric_step"


def prometheus_name(metric_name: str) -> str:
    """``rollout/reward_mean`` -> ``streamrft_rollout_reward_mean``; ``eval/gsm8k/mean@4`` ->
    ``streamrft_eval_gsm8k_mean_4``. Anything outside ``[A-Za-z0-9_]`` becomes ``_``."""
    return PROMETHEUS_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", metric_name)


@dataclass(frozen=True, slots=True)
class Row:
    """One metric value as the CSV holds it."""

    step: int
    role: str
    source: str
    name: str
    value: float
    created_at: int

    @property
    def key(self) -> tuple[str, str, int]:
        return self.source, self.name, self.step

    @classmethod
    def of(cls, metric: Metric) -> "Row":
        return cls(metric.step, metric.role, metric.source, metric.name, float(metric.value), int(metric.created_at))

    def as_csv(self) -> list[str]:
        return [str(self.step), self.role, self.source, self.name, repr(self.value), str(self.created_at)]

    @classmethod
    def from_csv(cls, fields: dict[str, str]) -> "Row":
        return cls(int(fields["step"]), fields["role"], fields["source"], fields["name"], float(fields["value"]),
                   int(fields["created_at"]))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def step_column(row: Row) -> str | None:
    """The steps.csv column of a row, or None when the wide form does not carry it."""
    prefixes = STEP_COLUMNS.get(row.role, ())
    return row.name if row.name.startswith(prefixes) else None


class MetricTable:
    """The de-duplicated metrics of one run and their two CSV files. No Kafka in here.

    ``metrics.csv`` grows by appending; it is rewritten (atomically) only when a value already written
    changes, or when the file had a torn last line. ``steps.csv`` is small and rewritten when it changes.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.long_path = directory / METRICS_CSV
        self.wide_path = directory / STEPS_CSV
        self.rows: dict[tuple[str, str, int], Row] = {}
        self.wide: dict[int, dict[str, float]] = {}
        self._appended: list[Row] = []
        self._rewrite = False
        self._wide_dirty = False
        self._load()

    def _load(self) -> None:
        if not self.long_path.is_file():
            return
        with self.long_path.open(newline="") as f:
            for line, fields in enumerate(csv.DictReader(f), start=2):
                try:
                    row = Row.from_csv(fields)
                except (KeyError, TypeError, ValueError):
                    logger.warning("%s:%d: unreadable row dropped (%r); the file will be rewritten",
                                   self.long_path, line, fields)
                    self._rewrite = True
                    continue
                self._put(row)
        self._wide_dirty = self._wide_dirty or not self.wide_path.is_file()
        logger.info("monitor: %d metric value(s) loaded from %s", len(self.rows), self.long_path)

    def _put(self, row: Row) -> None:
        self.rows[row.key] = row
        column = step_column(row)
        if column is not None:
            self.wide.setdefault(row.step, {})[column] = row.value
            self._wide_dirty = True

    def add(self, metric: Metric) -> Row | None:
        """Record a delivered metric. Returns its row when it is new or its value changed (keep last), None
        for a duplicate of what the table already holds."""
        row = Row.of(metric)
        old = self.rows.get(row.key)
        if old is not None and _same(old.value, row.value) and old.role == row.role:
            return None
        if old is None:
            self._appended.append(row)
        else:
            self._rewrite = True
        self._put(row)
        return row

    def flush(self) -> None:
        """Make the files hold everything added so far (called before offsets are committed)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._rewrite:
            _atomic_csv(self.long_path, LONG_COLUMNS, (row.as_csv() for row in self.rows.values()))
        elif self._appended:
            new_file = not self.long_path.is_file() or self.long_path.stat().st_size == 0
            with self.long_path.open("a", newline="") as f:
                writer = csv.writer(f)
                if new_file:
                    writer.writerow(LONG_COLUMNS)
                writer.writerows(row.as_csv() for row in self._appended)
                f.flush()
                os.fsync(f.fileno())
        self._appended.clear()
        self._rewrite = False
        if self._wide_dirty:
            self._write_wide()
            self._wide_dirty = False

    def wide_columns(self) -> list[str]:
        names = {name for values in self.wide.values() for name in values}
        order = {role: i for i, role in enumerate(STEP_COLUMNS)}

        def rank(name: str) -> tuple[int, str]:
            role = next(r for r, prefixes in STEP_COLUMNS.items() if name.startswith(prefixes))
            return order[role], name

        return sorted(names, key=rank)

    def _write_wide(self) -> None:
        columns = self.wide_columns()
        rows = ([str(step)] + [repr(values[c]) if c in values else "" for c in columns]
                for step, values in sorted(self.wide.items()))
        _atomic_csv(self.wide_path, ["step", *columns], rows)


def _atomic_csv(path: Path, header, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PrometheusExport:
    """Gauges of the latest value per metric, labelled role and source; a value for an older step than the
    one shown (a late or replayed record) does not move the gauge back."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._gauges: dict[str, Gauge | None] = {}
        self._latest_step: dict[tuple[str, str, str], int] = {}
        self.step_gauge = Gauge(STEP_GAUGE, "step of the latest value of each metric", ["metric", "role", "source"],
                                registry=registry)
        self.records = Counter("streamrft_monitor_records", "metric records read, by outcome (exported or "
                               "duplicate)", ["outcome"], registry=registry)
        self._gauges[STEP_GAUGE] = None  # a metric that sanitises to this name is not exported

    def _gauge(self, metric_name: str) -> Gauge | None:
        name = prometheus_name(metric_name)
        if name not in self._gauges:
            try:
                self._gauges[name] = Gauge(name, f"latest {metric_name}", ["role", "source"], registry=self.registry)
            except ValueError as exc:
                logger.warning("monitor: metric %s is not exported to Prometheus as %s: %s", metric_name, name, exc)
                self._gauges[name] = None
        return self._gauges[name]

    def update(self, row: Row) -> None:
        series = (row.name, row.role, row.source)
        if row.step < self._latest_step.get(series, row.step):
            return
        gauge = self._gauge(row.name)
        if gauge is None:
            return
        self._latest_step[series] = row.step
        gauge.labels(role=row.role, source=row.source).set(row.value)
        self.step_gauge.labels(metric=row.name, role=row.role, source=row.source).set(row.step)


class Monitor:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, source: str = "monitor"):
        self.config = config
        self.settings = config.monitor
        self.stop = stop
        self.source = source
        self.output_dir = config.output_dir
        self.table = MetricTable(self.output_dir)
        self.runtime = RoleRuntime(config, clients, stop, role="monitor", source=source, follows_sync=False)
        self.registry = self.runtime.registry
        self.prometheus = PrometheusExport(self.registry)
        self.lags = GroupLagGauges(self.registry, clients)
        for row in self.table.rows.values():  # a restarted monitor shows the last values at once
            self.prometheus.update(row)
        try:
            self.trackers = open_trackers(config)
        except BaseException:
            self.runtime.close()
            raise
        for tracker in self.trackers:
            self.runtime.on_close(type(tracker).__name__, tracker.close)
        self._eval_changed = False
        self.runtime.serve(self.settings.metrics_port)
        self.endpoint = self.runtime.endpoint
        self.metrics_port = self.endpoint.port
        self.consumer = self.runtime.consumer("metrics", config.consumer_group("monitor"), client_id=source)
        self.exported = 0
        logger.info("monitor: %s -> %s%s", config.topic("metrics"), self.output_dir,
                    f", Prometheus :{self.metrics_port}" if self.metrics_port is not None else "")

    # -- the loop (RoleRuntime.run: poll -> handle -> commit) ----------------------------------------------
    def run(self, max_idle_s: float | None = None) -> int:
        """Export until stopped, or until nothing new came for ``max_idle_s`` seconds once the consumer has
        its partitions. Returns the number of values exported (duplicates excluded)."""
        self._max_idle_s = max_idle_s
        # 3.-4.: a unit flushes the files, then commits the offsets
        self.runtime.run(self, self.runtime.unit_of_work(sinks=(self._flush,), consumer=self.consumer))
        return self.exported

    def start(self, unit) -> None:
        self._idle_since = time.monotonic()

    def handle(self, unit) -> bool:
        self.lags.maybe_sample()
        rejected_before = self.consumer.rejected
        batch = self.consumer.poll(MAX_RECORDS, POLL_S)  # 1.
        if not batch and self.consumer.rejected == rejected_before:
            if not self.consumer.assignment():
                self._idle_since = time.monotonic()  # still joining the group: not idle yet
            elif self._max_idle_s is not None and time.monotonic() - self._idle_since >= self._max_idle_s:
                return False
            return True
        self._idle_since = time.monotonic()
        for item in batch:
            self._export(item.record)  # 2.
        unit.touch()
        logger.debug("monitor: %d record(s) up to %s exported", len(batch), batch[-1].where if batch else "-")
        return True

    def finish(self, unit) -> None:
        pass

    # 2. export ------------------------------------------------------------------------------------------
    def _export(self, metric: Metric) -> None:
        row = self.table.add(metric)
        if row is None:
            self.prometheus.records.labels(outcome="duplicate").inc()
            return
        self.prometheus.records.labels(outcome="exported").inc()
        self.exported += 1
        self.prometheus.update(row)
        for tracker in self.trackers:
            tracker.add(row)
        self._eval_changed = self._eval_changed or row.name.startswith("eval/")

    # 3. flush -------------------------------------------------------------------------------------------
    def _flush(self) -> None:
        self.table.flush()
        table = eval_table(self.table.rows.values()) if self._eval_changed else None
        for tracker in self.trackers:
            tracker.flush()
            if table:
                tracker.log_eval_table(table)
        self._eval_changed = False

    def close(self) -> None:
        self.runtime.close()
        logger.info("monitor: stopped after %d value(s); files in %s", self.exported, self.output_dir)
