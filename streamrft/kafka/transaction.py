"""consume -> produce -> commit in one Kafka transaction (``send_offsets_to_transaction``).

Error handling, by the kind of error librdkafka reports:
- retriable: retried under a deadline;
- abortable (``txn_requires_abort``): the transaction is aborted and the consumer rewound to its committed
  offsets, so the same input is processed again and nothing half-done is visible to read_committed readers;
- fatal (e.g. fenced by a newer instance with the same transactional.id): raised; the process must stop.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from confluent_kafka import KafkaError, KafkaException

from .consumer import RecordConsumer
from .producer import RecordProducer

logger = logging.getLogger(__name__)


class FatalTransactionError(RuntimeError):
    """The producer can no longer be used (fenced, or a fatal broker error); restart the role."""


class TransactionAborted(Exception):
    """Raised inside ``produce`` callbacks to abort on purpose (the input is processed again)."""


class Transactor:
    """Runs units of work, each in one transaction together with the consumer's pending offsets."""

    def __init__(self, producer: RecordProducer, consumer: RecordConsumer | None = None, timeout: float = 60.0):
        if not producer.transactional:
            raise ValueError("Transactor needs a producer created with a transactional.id")
        self.producer = producer
        self.consumer = consumer
        self.timeout = timeout
        self.committed = 0
        self.aborted = 0
        producer.init_transactions(timeout)

    def run(self, produce: Callable[[RecordProducer], None]) -> bool:
        """1. begin  2. produce  3. add the consumed offsets  4. commit.  True if committed; False if the
        transaction was aborted and the consumer rewound (the caller simply polls again)."""
        raw = self.producer.raw
        try:
            raw.begin_transaction()
            produce(self.producer)
            offsets = self.consumer.pending_offsets() if self.consumer is not None else []
            if offsets:
                metadata = self.consumer.group_metadata()
                self._retrying("send_offsets_to_transaction",
                               lambda t: raw.send_offsets_to_transaction(offsets, metadata, t))
            self._retrying("commit_transaction", lambda t: raw.commit_transaction(t))
        except TransactionAborted as exc:
            self._abort(f"aborted by the caller: {exc}")
            return False
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal():
                raise FatalTransactionError(
                    f"fatal transaction error ({error.name()}): {error.str()}; another instance with the same "
                    "transactional.id may have taken over; restart this role"
                ) from exc
            if error.txn_requires_abort():
                self._abort(error.str())
                return False
            raise
        self.producer.raise_delivery_errors()
        if self.consumer is not None:
            self.consumer.forget_pending()
        self.committed += 1
        return True

    def _retrying(self, what: str, call: Callable[[float], None]) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                call(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.retriable() and time.monotonic() < deadline:
                    logger.warning("%s: %s; retrying", what, error.str())
                    time.sleep(0.2)
                    continue
                raise

    def _abort(self, why: str) -> None:
        logger.warning("transaction aborted (%s); rewinding to the committed offsets", why)
        self.aborted += 1
        self._retrying("abort_transaction", lambda t: self.producer.raw.abort_transaction(t))
        self.producer.discard_delivery_errors()  # the aborted records are discarded anyway
        if self.consumer is not None:
            self.consumer.rewind_to_committed()
