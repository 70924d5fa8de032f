"""The launcher's own Prometheus series (``launch.metrics_port``): how often ``streamrft run`` restarted each role
and whether it is up now. The roles' own endpoints cannot say this: a role that died serves nothing, and a
restarted one starts counting from zero."""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from streamrft.metric_catalog import prometheus_metric

from .processes import RoleProcess


class LauncherMetrics:
    """``streamrft_role_restarts_total{role}`` and ``streamrft_role_up{role}`` (1 running, 0 exited or waiting
    out its back-off), in a registry of their own for the launcher's endpoint."""

    def __init__(self, roles: Iterable[str], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.restarts = prometheus_metric("streamrft_role_restarts", self.registry)
        self.up = prometheus_metric("streamrft_role_up", self.registry)
        for role in roles:  # every role is a series from the start, so a first restart is a rise, not a new line
            self.restarts.labels(role=role)
            self.up.labels(role=role).set(0)

    def restarted(self, role: str) -> None:
        self.restarts.labels(role=role).inc()

    def observe(self, processes: Iterable[RoleProcess]) -> None:
        for process in processes:
            self.up.labels(role=process.name).set(1 if process.running else 0)
