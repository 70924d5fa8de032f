"""Which Kafka errors mean the cluster is not answering for now (a broker restarting, a leader or group
coordinator moving), so that what met one can be done again later."""
from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from .authorization import is_refusal

# errors of a cluster that is (for now) not answering, or whose leader or coordinator is moving
_UNANSWERED = (KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._WAIT_COORD,
               KafkaError._UNKNOWN_PARTITION, KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
               KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT,
               KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
               # a new leader whose high watermark is not caught up with its followers yet (after a failover, or
               # while the in-sync replicas are below min.insync.replicas): its offsets are asked again later
               KafkaError.OFFSET_NOT_AVAILABLE)


def unanswered(exc: BaseException) -> bool:
    """A Kafka error of a cluster that does not answer for now (a broker restarting, a leader or coordinator
    moving): a read-out that meets it can be done again later. Refusals and bugs are not."""
    if not isinstance(exc, KafkaException) or not isinstance(exc.args[0], KafkaError):
        return False
    error: KafkaError = exc.args[0]
    return not is_refusal(error) and (error.retriable() or error.code() in _UNANSWERED)
