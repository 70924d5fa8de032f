"""librdkafka's own clients with the run's connection settings and the client layer's guarantees (idempotence,
acks=all, read_committed, manual commits), and nothing else of the client layer: no records, no checks, no
dead letters. For baselines that measure what the client layer costs (``bench/dataplane.py``); roles never use
these."""
from __future__ import annotations

from confluent_kafka import Consumer, Producer

from ..config import KafkaConfig
from .props import consumer_props, producer_props


def _plain(props: dict) -> dict:
    return {k: v for k, v in props.items() if k != "logger"}  # librdkafka's default logging, as a bare client has


def raw_producer(kafka: KafkaConfig, bootstrap: str) -> Producer:
    return Producer(_plain(producer_props(kafka, bootstrap)))


def raw_consumer(kafka: KafkaConfig, bootstrap: str, group: str) -> Consumer:
    return Consumer(_plain(consumer_props(kafka, bootstrap, group)))
