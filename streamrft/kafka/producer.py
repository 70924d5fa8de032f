"""Idempotent (optionally transactional) producer of records. Delivery errors are held, never swallowed, and
raised at the next ``flush()``; a write the principal's ACLs do not allow is raised as an AuthorizationError
naming the topic."""
from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException, Producer

from streamrft.schemas import Record
from .authorization import Refusal, is_refusal
from .dlq import DeadLetter
from .retry import retrying
from .serde import Serde

logger = logging.getLogger(__name__)


class DeliveryError(Exception):
    """One or more records were not acknowledged by the broker; nothing after them may be committed."""

    def __init__(self, failures: list[str]):
        self.failures = failures
        shown = "; ".join(failures[:5]) + (f"; ... {len(failures) - 5} more" if len(failures) > 5 else "")
        super().__init__(f"{len(failures)} record(s) not delivered: {shown}")


class RecordProducer:
    """Thin wrapper over ``confluent_kafka.Producer`` that speaks records (see ``Serde``)."""

    def __init__(self, props: dict, serde: Serde, refuse: Refusal | None = None):
        self.serde = serde
        self.transactional = "transactional.id" in props
        self.transactional_id = props.get("transactional.id")
        self.refuse = refuse
        self._props = props
        self._producer = Producer(props)
        self._failures: list[str] = []
        self._refused: list[tuple[KafkaError, str]] = []  # (error, topic) of writes the ACLs did not allow
        self.topics_written: set[str] = set()  # since the last begin(): what a refused transaction wrote
        self._abandoned: list[Producer] = []  # stuck clients, kept referenced: destroying one would block too

    def reopen(self) -> None:
        """Replace the librdkafka client by a new one with the same properties (and transactional.id). For a
        client stuck in a call that ignores its timeout: the new one's ``init_transactions`` fences the old
        one, whose open transaction the broker then aborts. The old client is abandoned, not closed."""
        self._abandoned.append(self._producer)
        self._producer = Producer(self._props)
        self._failures = []
        self._refused = []

    # -- producing ------------------------------------------------------------------------------------------
    def produce(self, topic: str, record: Record, key: str | None = None,
                headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> None:
        """Encode and produce ``record``; its key defaults to the record's own (docs/architecture.md, "Topics")."""
        value = self.serde.encode(record, topic)
        self.produce_raw(topic, value, (key if key is not None else record.key).encode(), headers, partition)

    def produce_raw(self, topic: str, value: bytes | None, key: bytes | None,
                    headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> None:
        kwargs = {"topic": topic, "value": value, "key": key, "headers": headers, "on_delivery": self._on_delivery}
        self.topics_written.add(topic)
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(**kwargs)
                break
            except BufferError:
                # Local queue full: serve delivery reports until there is room. This is the producer's
                # backpressure; it never buffers without bound.
                self._producer.poll(0.1)
        self._producer.poll(0)

    def send_dead_letter(self, letter: DeadLetter) -> None:
        self.produce_raw(letter.topic, letter.value, letter.key, letter.headers)

    def _on_delivery(self, err: KafkaError | None, msg) -> None:
        # Only failures are reported (delivery.report.only.error): no Python call per delivered record.
        if err is not None:
            if is_refusal(err):
                self._refused.append((err, msg.topic()))
            key = msg.key().decode(errors="replace") if msg.key() else None
            self._failures.append(f"{msg.topic()}[{msg.partition()}] key={key}: {err.str()}")

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every record to be acknowledged; raise DeliveryError if any failed or is still queued."""
        remaining = self._producer.flush(timeout)
        self.raise_delivery_errors()
        if remaining:
            raise DeliveryError([f"{remaining} record(s) still queued after {timeout:.0f}s; is the broker up?"])

    def raise_delivery_errors(self) -> None:
        if self._refused and self.refuse is not None:
            (error, topic), self._refused, self._failures = self._refused[0], [], []
            raise self.refuse(error, "write", topic)
        if self._failures:
            failures, self._failures = self._failures, []
            raise DeliveryError(failures)

    def discard_delivery_errors(self) -> None:
        self._failures = []
        self._refused = []

    def refusal(self, error: KafkaError, consumer_group: str = ""):
        """The AuthorizationError for ``error`` met in this producer's transaction, naming what it refused:
        the transactional id, the consumer group of the offsets, or the topic(s) written (librdkafka does not
        say which); None when it is no refusal or no refusal builder was given."""
        if self.refuse is None or not is_refusal(error):
            return None
        if error.code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
            return self.refuse(error, "write", self.transactional_id or "")
        if error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
            return self.refuse(error, "read", consumer_group)
        return self.refuse(error, "write", " or ".join(sorted(self.topics_written)))

    def poll(self, timeout: float = 0.0) -> None:
        self._producer.poll(timeout)

    # -- transactions (see transaction.py for the error handling) ----------------------------------------------
    @property
    def raw(self) -> Producer:
        return self._producer

    @property
    def transaction_timeout_s(self) -> float:
        """How long the coordinator lets a transaction stay open before it aborts it (librdkafka's default 60 s)."""
        return float(self._props.get("transaction.timeout.ms", 60_000)) / 1000

    def init_transactions(self, timeout: float = 60.0) -> None:
        try:
            retrying("init_transactions", self._producer.init_transactions, timeout, pause=0.5)
        except KafkaException as exc:
            refused = self.refusal(exc.args[0])
            if refused is not None:
                raise refused from None
            raise

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued (non-transactional producers) and release the client."""
        if not self.transactional:
            self._producer.flush(timeout)
        self.raise_delivery_errors()
