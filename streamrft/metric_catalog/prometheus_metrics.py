"""The Prometheus series of every role, declared once, and the one factory that creates them.

A role creates a series with ``prometheus_metric(name, registry)``: its type, labels and help text come from the
declaration, and a name without one raises :class:`UndeclaredMetric`. The names are what dashboards, the UI,
the compose files' KEDA triggers and the tests scrape: change one only with all of them. ``name`` is what is
given to prometheus_client; a counter is exposed with ``_total`` after it (``streamrft_dead_letters_total``).
``unit`` is documentation only: prometheus_client would append it to the name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from .errors import UndeclaredMetric

HOME = "streamrft/metric_catalog/prometheus_metrics.py"

# the roles with an endpoint; each runs on streamrft.runtime.RoleRuntime, which creates the series of EVERY_ROLE
# (the bench's runtime makes them too, and serves no endpoint)
EVERY_ROLE = ("explorer", "rollout", "trainer", "monitor", "serve")
FOLLOWERS = ("rollout", "serve")  # the roles that load published weights (streamrft.weights.follower)


@dataclass(frozen=True)
class PrometheusMetric:
    name: str  # a pattern with one {placeholder} for a family whose names are made at run time
    kind: Literal["counter", "gauge"]
    help: str
    unit: str
    roles: tuple[str, ...]
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> str:
        """The name a scrape shows."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    @property
    def is_family(self) -> bool:
        return "{" in self.name

    def matches(self, name: str) -> bool:
        pattern = re.escape(self.name.split("{")[0]) + r"[A-Za-z0-9_]+" + re.escape(self.name.split("}")[-1])
        return re.fullmatch(pattern, name) is not None


def _c(name, help, unit, roles, labels=()):
    return PrometheusMetric(name, "counter", help, unit, tuple(roles), tuple(labels))


def _g(name, help, unit, roles, labels=()):
    return PrometheusMetric(name, "gauge", help, unit, tuple(roles), tuple(labels))


EXPORTED_FAMILY = "streamrft_{metric}"

PROMETHEUS_METRICS: tuple[PrometheusMetric, ...] = (
    # every role (streamrft/runtime/role_runtime.py)
    _c("streamrft_dead_letters", "records sent to a dead-letter topic", "records", EVERY_ROLE, ["topic", "reason"]),
    _c("streamrft_group_rejoins", "times the role went on from what it had committed after a unit could not "
       "commit (the group let it go, or the brokers were away): what it had done since is done again", "rejoins",
       EVERY_ROLE),
    # the weights' followers (streamrft/weights/)
    _c("streamrft_rollout_weights_caught_up", "collective versions this worker missed by broadcast and loaded "
       "from the object store", "versions", FOLLOWERS),
    _g("streamrft_rollout_model_version", "weights version loaded", "version", FOLLOWERS),
    _c("streamrft_rollout_weights_refused", "weight versions refused (every attempt), by reason", "attempts",
       FOLLOWERS, ["reason"]),
    # the launcher, streamrft run (streamrft/launch/metrics.py)
    _c("streamrft_role_restarts", "role processes restarted by streamrft run after a crash", "restarts",
       ["launcher"], ["role"]),
    _g("streamrft_role_up", "1 while the role's process runs, 0 once it exited", "0/1", ["launcher"], ["role"]),
    # explorer (consumers/explorer/role.py)
    _g("streamrft_explorer_step", "next explorer step", "step", ["explorer"]),
    _g("streamrft_explorer_model_version", "latest published weights version", "version", ["explorer"]),
    _g("streamrft_explorer_waiting", "1 while held back by staleness or trainer lag", "0/1", ["explorer"]),
    _g("streamrft_explorer_steps_in_flight", "training steps published, not finished", "steps", ["explorer"]),
    _c("streamrft_explorer_results", "rollout results by status", "results", ["explorer"], ["status"]),
    # rollout worker (consumers/rollout/metrics.py)
    _c("streamrft_rollout_requests", "requests handled, by status", "requests", ["rollout"], ["status"]),
    _c("streamrft_rollout_generated_tokens", "response tokens generated", "tokens", ["rollout"]),
    _c("streamrft_rollout_failed_samples", "samples their reward could not score (a judge's answer without a "
       "score), by reward; never trained on", "samples", ["rollout"], ["reward"]),
    _c("streamrft_rollout_busy_seconds", "seconds the engine ran with requests in flight", "seconds", ["rollout"]),
    _g("streamrft_rollout_swaps_in_flight", "weights versions loaded while requests ran (rollout.weight_update: "
       "in_flight)", "versions", ["rollout"]),
    # trainer (consumers/trainer/metrics.py)
    _g("streamrft_trainer_step", "trainer steps done (= version of the weights)", "steps", ["trainer"]),
    _g("streamrft_trainer_published_version", "last published weights version", "version", ["trainer"]),
    _g("streamrft_trainer_buffered_experiences", "read but not yet trained", "experiences", ["trainer"]),
    _g("streamrft_trainer_step_seconds", "duration of the last optimiser step", "seconds", ["trainer"]),
    _c("streamrft_trainer_experiences_trained", "experiences trained on", "experiences", ["trainer"]),
    _c("streamrft_trainer_experiences_dropped", "experiences dropped, by reason", "experiences", ["trainer"],
       ["reason"]),
    # monitor (consumers/monitor.py, consumers/lag_gauges.py)
    _g(EXPORTED_FAMILY, "latest value of the metrics-topic name `{metric}`, each character outside "
       "`[A-Za-z0-9_]` made `_` (`rollout/reward_mean` is `streamrft_rollout_reward_mean`)", "the metric's",
       ["monitor"], ["role", "source"]),
    _g("streamrft_metric_step", "step of the latest value of each metric", "step", ["monitor"],
       ["metric", "role", "source"]),
    _c("streamrft_monitor_records", "metric records read, by outcome (exported or duplicate)", "records",
       ["monitor"], ["outcome"]),
    _g("streamrft_consumer_group_lag_records", "records a read_committed reader of the consumer group has yet to "
       "get from the topic (transaction markers are not counted)", "records", ["monitor"], ["group", "topic"]),
    # serve mode (consumers/serve/role.py, consumers/serve/feedback_desk.py)
    _c("streamrft_serve_requests", "completion requests, by endpoint", "requests", ["serve"], ["endpoint"]),
    _c("streamrft_serve_generated_tokens", "response tokens generated", "tokens", ["serve"]),
    _c("streamrft_serve_feedback", "feedback received, by outcome (written, replayed, held, refused, failed)",
       "feedbacks", ["serve"], ["outcome"]),
    _g("streamrft_serve_running", "requests in the engine", "requests", ["serve"]),
    _g("streamrft_serve_waiting", "requests queued for the engine", "requests", ["serve"]),
    _g("streamrft_serve_batch_size", "requests the last engine step ran", "requests", ["serve"]),
    _g("streamrft_serve_batch_size_max", "the most requests one engine step ran", "requests", ["serve"]),
    _g("streamrft_serve_engine_steps", "engine steps", "steps", ["serve"]),
    _g("streamrft_serve_cancelled", "requests their client gave up on (they left the engine)", "requests",
       ["serve"]),
    _g("streamrft_serve_timed_out", "requests stopped at serve.request_timeout_s", "requests", ["serve"]),
    _g("streamrft_serve_refused", "requests refused with 429 (the engine and its queue were full)", "requests",
       ["serve"]),
    _g("streamrft_serve_weight_swaps", "weights versions swapped in", "versions", ["serve"]),
    _g("streamrft_serve_swap_pause_seconds_max", "the longest admission pause for a swap", "seconds", ["serve"]),
    _g("streamrft_serve_pending", "completions waiting for feedback", "completions", ["serve"]),
    _g("streamrft_serve_pending_expired", "completions dropped without feedback after serve.pending_ttl_s",
       "completions", ["serve"]),
    _g("streamrft_serve_pending_evicted", "completions dropped without feedback to keep serve.max_pending",
       "completions", ["serve"]),
    _g("streamrft_serve_receipts", "feedback receipts known (this server's and others')", "receipts", ["serve"]),
    _g("streamrft_serve_conversation_responses", "rewarded responses held until their conversation ends",
       "responses", ["serve"]),
    _g("streamrft_serve_conversations_expired", "rewarded responses of conversations that never ended",
       "responses", ["serve"]),
)

PROMETHEUS_BY_NAME: dict[str, PrometheusMetric] = {m.name: m for m in PROMETHEUS_METRICS}

_CLASSES = {"counter": Counter, "gauge": Gauge}
Series = Counter | Gauge  # what the factory makes


def prometheus_metric(name: str, registry: CollectorRegistry, *, family: str | None = None,
                      documentation: str | None = None) -> Series:
    """The series ``name`` on ``registry``, of its declaration's type and labels. ``family``: the declared
    pattern a run-time name belongs to (the monitor's ``EXPORTED_FAMILY``), with its own ``documentation``."""
    declared = PROMETHEUS_BY_NAME.get(family or name)
    if declared is None or (family is None and declared.is_family) or (family and not declared.matches(name)):
        raise UndeclaredMetric(f"Prometheus metric {name!r}{f' (family {family!r})' if family else ''} is not "
                               f"declared: declare it in {HOME} (PROMETHEUS_METRICS) with its type, labels, unit "
                               "and meaning")
    return _CLASSES[declared.kind](name, documentation or declared.help, list(declared.labels), registry=registry)
