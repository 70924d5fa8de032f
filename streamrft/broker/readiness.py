"""When an embedded broker that was launched is ready: every node listens, the cluster answers metadata with *our*
cluster id and every broker, a transactional producer id is handed out, and a consumer group finds its
coordinator (the transaction and offsets topics are created then, while every broker is up to hold a replica;
the roles depend on both). A failure says what did not happen in time, with the tail of the logs."""
from __future__ import annotations

import logging
import socket
import time
import uuid
from typing import Protocol

from ..config.kafka import EmbeddedBrokerConfig
from ..errors import BrokerError
from .node import HOST, BrokerNode, PortTaken

logger = logging.getLogger(__name__)


class Launched(Protocol):
    """What readiness asks of the broker it waits for (:class:`~.server.EmbeddedBroker`)."""

    config: EmbeddedBrokerConfig
    nodes: list[BrokerNode]
    cluster_id: str | None

    @property
    def kind(self) -> str: ...

    def log_tail(self) -> str: ...

    def admin(self): ...

    def client_properties(self) -> dict: ...


class Readiness:
    """Waits for ``broker`` to be usable (:meth:`wait`)."""

    def __init__(self, broker: Launched) -> None:
        self.broker = broker

    def wait(self, deadline: float) -> None:
        """Until the cluster is usable, in this order (or BrokerError with the logs' tail; PortTaken: another
        Kafka answered on a picked port)."""
        launched = time.monotonic()
        for node in self.broker.nodes:  # 1. every JVM listens on its client port
            self.port(node, deadline)
        logger.debug("ports open %.2f s after launch", time.monotonic() - launched)
        self.metadata(deadline, brokers=len(self.broker.nodes))  # 2. our cluster answers, every broker registered
        logger.debug("metadata answered %.2f s after launch", time.monotonic() - launched)
        self._transactions(deadline)  # 3. the transaction coordinator hands out producer ids
        logger.debug("transactions usable %.2f s after launch", time.monotonic() - launched)
        self._group_coordinator(deadline)  # 4. and the group coordinator answers
        logger.debug("group coordinator usable %.2f s after launch", time.monotonic() - launched)

    def check(self, deadline: float, what: str) -> None:
        for node in self.broker.nodes:
            if node.proc is not None:
                node.check_alive(what)
        if time.monotonic() > deadline:
            raise BrokerError(
                f"the Kafka {self.broker.kind} did not {what} within broker.start_timeout_s="
                f"{self.broker.config.start_timeout_s:g} s.\n{self.broker.log_tail()}\n"
                "On a slow or busy machine raise broker.start_timeout_s (STREAMRFT_BROKER__START_TIMEOUT_S)."
            )

    def port(self, node: BrokerNode, deadline: float) -> None:
        while True:
            self.check(deadline, f"open node {node.node_id}'s client port")
            try:
                socket.create_connection((HOST, node.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)

    def metadata(self, deadline: float, brokers: int) -> None:
        from confluent_kafka import KafkaException

        admin = self.broker.admin()
        while True:
            self.check(deadline, f"answer metadata with its {brokers} broker(s)")
            try:
                metadata = admin.list_topics(timeout=max(0.5, min(2.0, deadline - time.monotonic())))
            except KafkaException:
                time.sleep(0.05)
                continue
            if metadata.cluster_id != self.broker.cluster_id:
                raise PortTaken()  # someone else's Kafka answers on a port we picked
            if len(metadata.brokers) >= brokers:
                return
            time.sleep(0.1)

    def _transactions(self, deadline: float) -> None:
        """The first request creates and loads the transaction topic; librdkafka retries "not available" /
        "loading" on its own fixed 500 ms timers. A timed-out init_transactions() resumes
        where it left off when called again."""
        from confluent_kafka import KafkaError, KafkaException, Producer

        props = {**self.broker.client_properties(), "transactional.id": f"streamrft-ready-probe-{uuid.uuid4().hex[:8]}"}
        producer = Producer(props)
        while True:
            self.check(deadline, "accept transactions")
            try:
                producer.init_transactions(max(0.1, min(2.0, deadline - time.monotonic())))
                break
            except KafkaException as exc:
                error = exc.args[0]
                if error.fatal():
                    raise BrokerError(f"the broker refused transactions: {error.str()}\n{self.broker.log_tail()}") from exc
                logger.debug("init_transactions: %s", error)
                if error.code() != KafkaError._TIMED_OUT:
                    # e.g. COORDINATOR_LOAD_IN_PROGRESS handed back to us: start over with a fresh producer
                    producer = Producer(props)
        close = getattr(producer, "close", None)  # Producer.close() only exists in newer confluent-kafka
        if close:
            close()

    def _group_coordinator(self, deadline: float) -> None:
        """Looking up a group's coordinator creates the offsets topic. In a cluster it must exist before a broker
        can be lost: it is created with every replica or not at all. A consumer's committed() asks, not the admin
        API's list_consumer_group_offsets, which confluent-kafka 2.x can crash on while the coordinator loads."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        consumer = Consumer({**self.broker.client_properties(), "group.id": f"streamrft-ready-probe-{uuid.uuid4().hex[:8]}"})
        try:
            while True:
                self.check(deadline, "find a group coordinator")
                try:
                    consumer.committed([TopicPartition("streamrft-ready-probe", 0)],
                                       timeout=max(0.5, min(2.0, deadline - time.monotonic())))
                    return
                except KafkaException as exc:
                    logger.debug("group coordinator: %s", exc.args[0])
                    time.sleep(0.1)
        finally:
            consumer.close()
