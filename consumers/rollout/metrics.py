"""What the rollout worker counts: its Prometheus counters, and the metrics each commit writes to ``metrics``."""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry

from streamrft.engines.rollout import Assembled, RolloutCore
from streamrft.metric_catalog import prometheus_metric


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry, core: RolloutCore) -> None:
        self.core = core
        self.requests = prometheus_metric("streamrft_rollout_requests", registry)
        self.tokens = prometheus_metric("streamrft_rollout_generated_tokens", registry)
        self.failed_samples = prometheus_metric("streamrft_rollout_failed_samples", registry)
        self.busy = prometheus_metric("streamrft_rollout_busy_seconds", registry)
        prometheus_metric("streamrft_rollout_swaps_in_flight", registry).set_function(lambda: core.swaps_in_flight)
        self._unscored: collections.Counter[str] = collections.Counter()  # by reward, since the last commit
        self._penalties: list[float] = []  # overlong penalties since the last commit (rollout.overlong_penalty)
        self._busy_s = 0.0
        self._last_commit = time.monotonic()

    def stepped(self) -> None:
        """After each step of the core: the engine's busy time."""
        self.busy.inc(self.core.busy_s - self._busy_s)
        self._busy_s = self.core.busy_s

    def assembled(self, assembled: Assembled) -> None:
        self.tokens.inc(assembled.tokens)
        for reward in assembled.unscored:
            self.failed_samples.labels(reward).inc()
            self._unscored[reward] += 1
        self._penalties += assembled.penalties

    def of_commit(self, requests: int, samples: int) -> dict[str, float]:
        """The metrics of a commit of ``requests`` requests and their ``samples`` experiences."""
        elapsed = time.monotonic() - self._last_commit
        failed = {f"{reward}/failed_samples": count for reward, count in self._unscored.items()}
        self._unscored.clear()
        return {"rollout_worker/requests": requests, "rollout_worker/samples": samples,
                "rollout_worker/in_flight": self.core.running,
                "rollout_worker/samples_per_s": samples / max(elapsed, 1e-6), **failed, **self._overlong()}

    def _overlong(self) -> dict[str, float]:
        """The mean overlong penalty of the samples shaped since the last commit, and the share punished."""
        penalties, self._penalties = self._penalties, []
        if not penalties:
            return {}
        return {"rollout_worker/overlong_penalty_mean": sum(penalties) / len(penalties),
                "rollout_worker/overlong_punished_frac": sum(p < 0 for p in penalties) / len(penalties)}

    def committed(self, statuses: list[str]) -> None:
        self._last_commit = time.monotonic()
        for status in statuses:
            self.requests.labels(status).inc()
