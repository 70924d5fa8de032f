"""Every metric name of the run, declared once: the Prometheus series each role serves
(:mod:`.prometheus_metrics`, created only through :func:`prometheus_metric`, so a series cannot exist without its
declaration) and the names the roles write to the ``metrics`` topic (:mod:`.topic_metrics`, checked where the
records are built, :class:`streamrft.telemetry.MetricsPublisher`). ``docs/reference/metrics.md`` is generated
from both (``python -m streamrft.reference``). Torch-free: the engines' metric names are declared here too, as
names, and the engines never import this."""
from __future__ import annotations

from .errors import UndeclaredMetric
from .prometheus_metrics import EXPORTED_FAMILY, PROMETHEUS_BY_NAME, PROMETHEUS_METRICS, PrometheusMetric, \
    Series, prometheus_metric
from .topic_metrics import STRICT_ENV, TOPIC_METRICS, TopicMetric, check_emitted, declaration_of

__all__ = ["EXPORTED_FAMILY", "PROMETHEUS_BY_NAME", "PROMETHEUS_METRICS", "STRICT_ENV", "TOPIC_METRICS",
           "PrometheusMetric", "Series", "TopicMetric", "UndeclaredMetric", "check_emitted", "declaration_of",
           "prometheus_metric"]
