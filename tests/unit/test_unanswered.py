"""Which Kafka errors mean "the cluster does not answer for now" (asked again later) and which do not."""
from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from streamrft.kafka.unanswered import unanswered


@pytest.mark.parametrize("code", [KafkaError._TRANSPORT, KafkaError.NOT_LEADER_FOR_PARTITION,
                                  KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.OFFSET_NOT_AVAILABLE])
def test_a_moving_leader_or_coordinator_is_asked_again(code):
    assert unanswered(KafkaException(KafkaError(code)))


@pytest.mark.parametrize("error", [KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)),
                                   KafkaException(KafkaError(KafkaError.INVALID_CONFIG)), ValueError("a bug")])
def test_refusals_and_bugs_are_not(error):
    assert not unanswered(error)
