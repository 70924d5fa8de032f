"""``docs/reference/metrics.md``: every metric of the run, per role, from its one declaration
(:mod:`streamrft.metric_catalog`)."""
from __future__ import annotations

from streamrft.metric_catalog import PROMETHEUS_METRICS, TOPIC_METRICS, PrometheusMetric, TopicMetric
from streamrft.metric_catalog.prometheus_metrics import EVERY_ROLE

from .markdown_cells import code, generated_notice, table, text

PATH = "docs/reference/metrics.md"

ROLE_TITLES = {
    EVERY_ROLE: "every role",
    ("rollout", "serve"): "rollout workers and serve mode (the weights they load)",
    ("launcher",): "the launcher (`streamrft run`, `launch.metrics_port`)",
    ("explorer",): "explorer (`explorer.metrics_port`)",
    ("rollout",): "rollout workers (`rollout.metrics_port`)",
    ("trainer",): "trainer (`trainer.metrics_port`)",
    ("monitor",): "monitor (`monitor.metrics_port`)",
    ("serve",): "serve mode (`/metrics` of its HTTP port)",
}
TOPIC_TITLES = {("explorer",): "explorer", ("rollout",): "rollout workers", ("trainer",): "trainer"}

INTRO = """\
Every metric name is declared once, in `streamrft/metric_catalog/`: a role creates a Prometheus series only from
its declaration, and a name a role writes to the `metrics` topic without one is an error with
`STREAMRFT_STRICT_METRICS=1` (the test suite sets it), else a warning, once. Add a metric there first; this page
follows with `python -m streamrft.reference`."""

PROMETHEUS_INTRO = """\
Each role serves its series on its own endpoint, labelled as shown (`every role`: each of explorer, rollout,
trainer, monitor and serve). A counter is exposed with `_total` after its name."""

TOPIC_INTRO = """\
What the roles write to the run's `metrics` topic (`Metric` records: source, role, name, value, step), which the
monitor turns into `metrics.csv`, `steps.csv`, the trackers and Prometheus gauges
(`rollout/reward_mean` -> `streamrft_rollout_reward_mean{role, source}`). A part in braces varies: `{taskset}` is
a taskset's name, `{k}` an eval taskset's `repeat_times`, `{reward}` a reward function's name. The explorer's and
the trainer's values are of one step; a rollout worker's are of one commit. Serve mode, the bench and the monitor
write none."""


def _prometheus_row(m: PrometheusMetric) -> tuple[str, ...]:
    labels = ", ".join(code(label) for label in m.labels) or "-"
    return code(m.exposed), m.kind, labels, text(m.unit), text(m.help)


def _topic_row(m: TopicMetric) -> tuple[str, ...]:
    return code(m.name), text(m.unit), text(m.meaning)


def _groups(metrics, key) -> dict:
    groups: dict = {}
    for m in metrics:
        groups.setdefault(key(m), []).append(m)
    return groups


def render() -> str:
    parts = [generated_notice("the declarations of streamrft/metric_catalog/"), "# Metrics", INTRO,
             "## Prometheus", PROMETHEUS_INTRO]
    for roles, metrics in _groups(PROMETHEUS_METRICS, lambda m: m.roles).items():
        parts += [f"### {ROLE_TITLES.get(roles, ', '.join(roles))}",
                  table(("name", "type", "labels", "unit", "meaning"), [_prometheus_row(m) for m in metrics])]
    parts += ["## The metrics topic", TOPIC_INTRO]
    for roles, metrics in _groups(TOPIC_METRICS, lambda m: m.roles).items():
        parts += [f"### {TOPIC_TITLES.get(roles, ', '.join(roles))}",
                  table(("name", "unit", "meaning"), [_topic_row(m) for m in metrics])]
    return "\n\n".join(parts) + "\n"
