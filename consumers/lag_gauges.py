"""The run's consumer groups' lag in records, for Prometheus: ``streamrft_consumer_group_lag_records{group,
topic}``, what a read_committed reader of the group has yet to get (transaction markers are no lag;
``streamrft/kafka/records_lag.py``). The monitor samples it every ``SAMPLE_S`` seconds; the rollout workers'
KEDA trigger scales on it (``streamrft/deploy/kubernetes.py``).

Counting reads the lagging records, so the monitor's principal needs what the ``viewer`` role has (READ on the
run's topics, DESCRIBE of its groups); refused, the gauge stays empty and says so once."""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry

from streamrft.errors import AuthorizationError
from streamrft.kafka import KafkaClients, unanswered
from streamrft.metric_catalog import prometheus_metric

logger = logging.getLogger(__name__)

SAMPLE_S = 10.0
LAG_GAUGE = "streamrft_consumer_group_lag_records"


class GroupLagGauges:
    def __init__(self, registry: CollectorRegistry, clients: KafkaClients, sample_s: float = SAMPLE_S):
        self.clients = clients
        self.sample_s = sample_s
        self.gauge = prometheus_metric(LAG_GAUGE, registry)
        self._sampled_at = float("-inf")
        self._refused = False

    def maybe_sample(self) -> None:
        """Sample when the last sample is ``sample_s`` old; a cluster that does not answer keeps the last values."""
        now = time.monotonic()
        if self._refused or now - self._sampled_at < self.sample_s:
            return
        self._sampled_at = now
        try:
            reports = self.clients.describe()
        except AuthorizationError as exc:
            self._refused = True
            logger.warning("monitor: consumer-group lag not exported (%s); give the monitor's principal the viewer "
                           "role's rights to export it", exc)
            return
        except Exception as exc:  # noqa: BLE001 - the client layer's exception; unanswered() tells which
            if not unanswered(exc):
                raise
            logger.warning("monitor: consumer-group lag not sampled now: %s", exc)
            return
        for report in reports:
            for group, records in report.groups.items():
                self.gauge.labels(group=group, topic=report.name).set(records)
