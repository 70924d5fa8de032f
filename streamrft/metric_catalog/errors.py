"""The one error of the catalog: a metric name used without a declaration."""
from __future__ import annotations


class UndeclaredMetric(ValueError):
    """A metric name that no declaration of :mod:`streamrft.metric_catalog` covers; the message names the file
    to declare it in."""
