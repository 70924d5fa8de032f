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
- ``<output_dir>/metrics.csv``, long form (step, role, source, name, value, created_at; :mod:`.metric_table`),
  and ``<output_dir>/steps.csv``, wide form: one row per step with the explorer's ``rollout/*``, ``time/*`` and
  ``eval/*`` values and the trainer's ``actor/*`` and ``trainer/*`` values for that step (:mod:`.steps_table`).
  Memory holds a window of recent steps, not the run: a run lasts days.

The loop, as numbered steps (``handle``, then the unit's commit): 1. poll and decode (undecodable records go to
the DLQ); 2. export each new or changed value; 3. flush the files; 4. commit the offsets. A crash between 3 and 4
redelivers records the files already hold; the table, reloaded from ``metrics.csv`` at start, skips them.
"""
from __future__ import annotations

import logging
import re
import time

from prometheus_client import CollectorRegistry

from streamrft.config import RunConfig
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.metric_catalog import EXPORTED_FAMILY, Series, prometheus_metric
from streamrft.runtime import RoleRuntime
from streamrft.schemas import Metric

from .lag_gauges import GroupLagGauges
from .metric_table import METRICS_CSV, MetricTable, Row
from .steps_table import STEPS_CSV
from .trackers import eval_table, open_trackers

__all__ = ["METRICS_CSV", "STEPS_CSV", "MetricTable", "Monitor", "PrometheusExport", "Row", "prometheus_name"]

logger = logging.getLogger(__name__)

POLL_S = 0.5
MAX_RECORDS = 1000
PROMETHEUS_PREFIX = "streamrft_"
STEP_GAUGE = "streamrft_metric_step"


def prometheus_name(metric_name: str) -> str:
    """``rollout/reward_mean`` -> ``streamrft_rollout_reward_mean``; ``eval/gsm8k/mean@4`` ->
    ``streamrft_eval_gsm8k_mean_4``. Anything outside ``[A-Za-z0-9_]`` becomes ``_``."""
    return PROMETHEUS_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", metric_name)


class PrometheusExport:
    """Gauges of the latest value per metric, labelled role and source; a value for an older step than the
    one shown (a late or replayed record) does not move the gauge back."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._gauges: dict[str, Series | None] = {}
        self._latest_step: dict[tuple[str, str, str], int] = {}
        self.step_gauge = prometheus_metric(STEP_GAUGE, registry)
        self.records = prometheus_metric("streamrft_monitor_records", registry)
        self._gauges[STEP_GAUGE] = None  # a metric that sanitises to this name is not exported

    def _gauge(self, metric_name: str) -> Series | None:
        name = prometheus_name(metric_name)
        if name not in self._gauges:
            try:
                self._gauges[name] = prometheus_metric(name, self.registry, family=EXPORTED_FAMILY,
                                                       documentation=f"latest {metric_name}")
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
        for row in self.table.latest.values():  # a restarted monitor shows the last values at once
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
        table = eval_table(self.table.evals.values()) if self._eval_changed else None
        for tracker in self.trackers:
            tracker.flush()
            if table:
                tracker.log_eval_table(table)
        self._eval_changed = False

    def close(self) -> None:
        self.runtime.close()
        logger.info("monitor: stopped after %d value(s); files in %s", self.exported, self.output_dir)
