"""Metrics out of every role: ``Metric`` records on the run's ``metrics`` topic (for the monitor, TensorBoard,
CSV) and a Prometheus endpoint for scraping."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

from .kafka import RecordProducer
from .metric_catalog import check_emitted
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
        transactional, so metrics of an aborted unit of work vanish with it. Each name must be declared for the
        role (``streamrft.metric_catalog``): an error in the tests, a warning once in a run."""
        check_emitted(values, self.role)
        for name, value in values.items():
            self.producer.produce(self.topic, Metric(source=self.source, role=self.role, name=name,
                                                     value=float(value), step=step, tags=dict(tags or {})))


class PrometheusEndpoint:
    """A role's ``/metrics`` HTTP endpoint; ``port`` (and ``host``) are None when it is off or could not bind."""

    def __init__(self, server=None, host: str | None = None):
        self._server = server
        self.port = server.server_port if server is not None else None
        self.host = host if server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def serve_prometheus(port: int | None, registry: CollectorRegistry, host: str = "127.0.0.1") -> PrometheusEndpoint:
    """Expose ``registry`` on ``host:port`` (port 0 = any free port, None = off). ``host`` is loopback unless
    the run's ``metrics_host`` says otherwise (``0.0.0.0`` in containers, for a Prometheus on another host):
    the endpoint has no authentication. When the port is taken (another role on this host) the role goes on
    without it — its metrics still flow through the metrics topic."""
    if port is None:
        return PrometheusEndpoint()
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        logger.warning("Prometheus endpoint not started on %s:%s (%s); set *.metrics_port to a free port or "
                       "metrics_host to an address of this machine", host, port, exc.strerror)
        return PrometheusEndpoint()
    logger.info("Prometheus metrics on %s:%d/metrics", host, server.server_port)
    return PrometheusEndpoint(server, host)
