"""The trainer's Prometheus series, and the counts of what it did not train (stale, incomplete, passed over),
which go with the next step's metrics."""
from __future__ import annotations

from streamrft.metric_catalog import prometheus_metric
from streamrft.runtime import RoleRuntime


class TrainerMetrics:
    def __init__(self, runtime: RoleRuntime, port: int | None):
        registry = runtime.registry
        self.step = prometheus_metric("streamrft_trainer_step", registry)
        self.published = prometheus_metric("streamrft_trainer_published_version", registry)
        self.buffered = prometheus_metric("streamrft_trainer_buffered_experiences", registry)
        self.step_seconds = prometheus_metric("streamrft_trainer_step_seconds", registry)
        self.trained = prometheus_metric("streamrft_trainer_experiences_trained", registry)
        self.dropped = prometheus_metric("streamrft_trainer_experiences_dropped", registry)
        runtime.serve(port)
        self.dropped_stale = self.dropped_incomplete = 0  # since the last step's metrics
        self.passed_over = 0  # since the start

    def drop(self, reason: str, count: int) -> None:
        """``count`` experiences dropped for ``reason`` (stale, incomplete, bad-pair)."""
        self.dropped.labels(reason).inc(count)
        if reason == "stale":
            self.dropped_stale += count
        elif reason == "incomplete":
            self.dropped_incomplete += count

    def pass_over(self) -> int:
        """One more experience this trainer does not train; how many so far."""
        self.passed_over += 1
        return self.passed_over

    def stepped(self, step: int, seconds: float, trained: int) -> None:
        self.step.set(step)
        self.step_seconds.set(seconds)
        self.trained.inc(trained)

    def counts(self) -> dict[str, float]:
        """What was not trained, for the step's metrics; the drops count again from zero."""
        out = {"trainer/dropped_stale": float(self.dropped_stale),
               "trainer/dropped_incomplete": float(self.dropped_incomplete),
               "trainer/passed_over": float(self.passed_over)}
        self.dropped_stale = self.dropped_incomplete = 0
        return out
