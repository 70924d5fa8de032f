"""What every role is built on (composition, not inheritance): its producer and ``Transactor``, its view of
``sync``, its metrics (records on ``metrics`` and a Prometheus registry + endpoint), its consumers, the one role
loop, and one ``close()`` that releases all of them in reverse order.

A role creates one ``RoleRuntime``, declares its own Prometheus metrics on ``runtime.registry``, calls
``runtime.serve()`` and hands itself to :meth:`RoleRuntime.run`, the loop every role runs (poll → handle →
commit; docs/architecture.md, "Roles"):

1. poll ``sync`` and ``control`` (every role that follows the trainer's and the explorer's signals);
2. ``role.handle(unit)``: poll the role's own topics and handle what came, staging what it produces, the offsets
   it consumed and its after-commit bookkeeping on the :class:`~streamrft.runtime.unit_of_work.UnitOfWork`;
3. ``unit.commit()``: all of it durable as one (one Kafka transaction for a transactional role, with the one
   abort policy of ``streamrft.kafka.transaction``).

``role.start(unit)`` runs before the first pass and ``role.finish(unit)`` after the last (the role's work is over, or
a stop was requested); what ``finish`` stages is committed too.

When the commit fails and nothing of the unit is visible (``TransactionFailed``: the role's consumer group let it
go, ``MembershipLost``, as a member can during a group coordinator's failover; or the brokers were away past the
unit's deadline), a role that defines ``rejoin(unit)`` drops what it holds beyond its last commit and goes on from
what is committed, as a restart would: the rollout worker from its committed offsets, the explorer from its last
committed state record, the trainer from its newest checkpoint. ``FatalTransactionError`` (a newer instance with
the same transactional.id took over) still stops the role: taking the id back would fence the newer one.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Protocol

from prometheus_client import CollectorRegistry

from streamrft.config import RunConfig
from streamrft.config.topics import KINDS_BY_NAME
from streamrft.kafka import KafkaClients, RecordConsumer, TransactionFailed, Transactor
from streamrft.lifecycle import StopSignal
from streamrft.metric_catalog import prometheus_metric
from streamrft.sync import SyncView
from streamrft.validation import TOPIC_CHECKS
from streamrft.telemetry import MetricsPublisher, PrometheusEndpoint, serve_prometheus
from .unit_of_work import UnitOfWork

logger = logging.getLogger(__name__)


class Role(Protocol):
    """What :meth:`RoleRuntime.run` drives."""

    def start(self, unit: UnitOfWork) -> None:
        """Catch up, restore state, stage what the start writes; before the first pass."""

    def handle(self, unit: UnitOfWork) -> bool:
        """One pass: poll the role's topics, handle what came, stage it on ``unit``. False once the role's work
        is over."""

    def finish(self, unit: UnitOfWork) -> None:
        """After the last pass (done, or stopped): stage what the end writes."""


class RoleRuntime:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *, role: str, source: str,
                 transactional_id: str | None = None, producer_extra: dict | None = None,
                 owns_sync_dead_letters: bool = False, follows_sync: bool = True):
        """``role`` names the kind (explorer, rollout, trainer, monitor); ``source`` this instance. With a
        ``transactional_id`` the producer is transactional (it also fences an older instance of the role).
        ``follows_sync=False`` (the monitor): no view of ``sync``."""
        self.config = config
        self.clients = clients
        self.stop = stop
        self.role = role
        self.source = source
        self.registry = CollectorRegistry()
        self._dead_letters = prometheus_metric("streamrft_dead_letters", self.registry)
        self._rejoins = prometheus_metric("streamrft_group_rejoins", self.registry)
        self._closers: list[tuple[str, Callable[[], None]]] = []
        self.producer = clients.producer(transactional_id=transactional_id, client_id=source,
                                         extra=producer_extra)
        self._transactor: Transactor | None = None
        if transactional_id is not None:
            self._transactor = Transactor(self.producer)
        self.sync: SyncView | None = None
        if follows_sync:
            self.sync = self._closing("sync view", SyncView(clients, client_id=f"{source}-sync",
                                                            dead_letters=owns_sync_dead_letters))
        self.metrics = MetricsPublisher(self.producer, config.topic("metrics"), source, role)
        self.endpoint = PrometheusEndpoint()

    def _closing(self, what: str, thing):
        self._closers.append((what, thing.close))
        return thing

    def on_close(self, what: str, close: Callable[[], None]) -> None:
        """Release something of the role's own (an engine, a publisher) with the rest, before the clients."""
        self._closers.append((what, close))

    # -- clients ------------------------------------------------------------------------------------------------
    def consumer(self, topic: str, group: str, *, check_options: dict | None = None,
                 topics: list[str] | None = None, **kwargs) -> RecordConsumer:
        """A consumer of one of the run's topics (``tasks``, ...): of the topic kind's record type, each record
        checked by the kind's check (``streamrft.validation.TOPIC_CHECKS``, given ``check_options``); its dead
        letters are counted in ``streamrft_dead_letters{topic, reason}``. ``topics``: several topics of that kind
        (full names: the tasksets' own ``tasks.<name>``) instead of the kind's one."""
        check = partial(TOPIC_CHECKS[topic], **(check_options or {}))
        consumer = self.clients.consumer(topics or [self.config.topic(topic)], KINDS_BY_NAME[topic].record, group,
                                         check=check, on_dead_letter=self._count_dead_letter, **kwargs)
        return self._closing(f"{topic} consumer", consumer)

    def _count_dead_letter(self, topic: str, reason: str) -> None:
        self._dead_letters.labels(topic, reason).inc()

    def bind(self, consumer: RecordConsumer) -> None:
        """Commit ``consumer``'s offsets inside every transaction (consume -> produce -> commit)."""
        self._transactor.consumer = consumer

    def unit_of_work(self, *, state: Callable[[], list[tuple[str, Any]]] | None = None,
                     sinks: tuple[Callable[[], None], ...] = (), consumer: RecordConsumer | None = None) -> UnitOfWork:
        """A unit of this role's work (see :mod:`streamrft.runtime.unit_of_work` for the arguments)."""
        return UnitOfWork(self.source, self.producer, self.metrics, self._transactor, state=state, sinks=sinks,
                          consumer=consumer)

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, role: Role, unit: UnitOfWork | None = None, *, follows_signals: bool = True) -> None:
        """The role loop (module docstring), until the role's work is over or a stop is requested.
        ``follows_signals=False``: the role polls ``sync`` itself (serve mode's engine loop, at its own pace) or
        not at all (its feedback writer), so that the view is used from one thread only."""
        unit = unit or self.unit_of_work()
        role.start(unit)
        unit.commit()
        going = True
        while going and not self.stop.requested:
            if self.sync is not None and follows_signals:
                self.sync.poll(0)  # 1.
            going = role.handle(unit)  # 2.
            try:
                unit.commit()  # 3.
            except TransactionFailed as exc:  # MembershipLost included; never FatalTransactionError
                rejoin = getattr(role, "rejoin", None)
                if rejoin is None:
                    raise
                logger.warning("%s: %s; going on from what is committed instead", self.source, exc)
                self._rejoins.inc()
                rejoin(unit)
        role.finish(unit)
        unit.commit()

    def serve(self, port: int | None) -> None:
        """Expose the registry once the role has declared its metrics."""
        self.endpoint = serve_prometheus(port, self.registry, host=self.config.metrics_host)

    # -- the end -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything, newest first (the role's own things before the clients they use); best effort:
        the broker expires members that leave without a word anyway."""
        closers = [*reversed(self._closers), ("producer", self.producer.close),
                   ("metrics endpoint", self.endpoint.close)]
        for what, close in closers:
            try:
                close()
            except Exception:
                logger.warning("%s: closing its %s failed", self.source, what, exc_info=True)
        self._closers.clear()
