"""The one retry-until-deadline loop of the Kafka layer: retriable librdkafka errors are tried again until the
deadline; anything else, and a retriable error after the deadline, is raised."""
from __future__ import annotations

import logging
import time
from typing import Callable

from confluent_kafka import KafkaError, KafkaException

logger = logging.getLogger(__name__)


def retrying(what: str, call: Callable[[float], None], timeout: float, pause: float = 0.2,
             retry_when: Callable[[KafkaError], bool] = KafkaError.retriable) -> None:
    """``call(remaining_seconds)`` until it returns; ``retry_when(error)`` says which errors to try again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call(max(1.0, deadline - time.monotonic()))
            return
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if retry_when(error) and time.monotonic() < deadline:
                logger.warning("%s: %s; retrying", what, error.str())
                time.sleep(pause)
                continue
            raise
