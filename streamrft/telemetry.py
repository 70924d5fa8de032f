"""Metrics out of every role: ``Metric`` records on the run's ``metrics`` topic (for the monitor, TensorBoard,
CSV) and a Prometheus endpoint for scraping."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

from .kafka import RecordProducer
from streamrft.schemas import Metric

logger = logging.getLogger(__name__)


class MetricsPublisher:
    """Publishes namespaced scalars (``rollout/reward_mean``, ``actor/pg_loss``) for one role instance."""

    def __init__(self, producer: RecordProducer, topic: str, source: str, role: str):
        self.producer = producer
        self.topic = topic
        self.source = source
        self.role = role

    def publish(self, step: int, values: dict[str, float], tags: dict[str, str] | None = None) -> None:
        """Produce one Metric per value. Call inside the role's transaction when its producer is
        transactional, so metrics of an aborted unit of work vanish with it."""
        for name, value in values.items():
            self.producer.produce(self.topic, Metric(source=self.source, role=self.role, name=name,
                                                     value=float(value), step=step, tags=dict(tags or {})))


class PrometheusEndpoint:
    """A role's ``/metrics`` HTTP endpoint; ``port`` is None when it is off or could not bind."""

    def __init__(self, server=None):
        self._server = server
        self.port = server.server_port if server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def serve_prometheus(port: int | None, registry: CollectorRegistry) -> PrometheusEndpoint:
    """Expose ``registry`` on ``port`` (0 = any free port, None = off). When the port is taken (another role on
    this host) the role goes on without it — its metrics still flow through the metrics topic."""
    if port is None:
        return PrometheusEndpoint()
    try:
        server, _ = start_http_server(port, addr="0.0.0.0", registry=registry)
    except OSError as exc:
        logger.warning("Prometheus endpoint not started on port %s (%s); set *.metrics_port to a free port",
                       port, exc.strerror)
        return PrometheusEndpoint()
    logger.info("Prometheus metrics on :%d/metrics", server.server_port)
    return PrometheusEndpoint(server)
