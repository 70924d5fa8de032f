"""A task producer written only against the schema registry and the contract file, as a team in another codebase
would write one: confluent-kafka's SchemaRegistryClient, AvroSerializer and Producer, and schemas/Task.avsc read
from disk. No streamrft import (the test checks that). Produces ``count`` arithmetic tasks to ``topic``.

    python registry_task_producer.py REGISTRY_URL BOOTSTRAP TOPIC TASK_AVSC COUNT
"""
import json
import sys
import time

from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, StringSerializer


def main(registry_url: str, bootstrap: str, topic: str, avsc_path: str, count: int) -> None:
    registry = SchemaRegistryClient({"url": registry_url})
    with open(avsc_path) as fh:
        serializer = AvroSerializer(registry, fh.read())  # registers the schema under "<topic>-value"
    keys = StringSerializer()
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    failures = []
    for i in range(count):
        a, b = i + 1, 2 * i + 3
        task = {"task_id": f"outside-{i}", "taskset": "outside", "workflow": "arithmetic",
                "payload": json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}),
                "reward_fn": None, "repeat_times": None, "created_at": int(time.time() * 1000)}
        value = serializer(task, SerializationContext(topic, MessageField.VALUE))
        producer.produce(topic, key=keys(task["task_id"]), value=value,
                         on_delivery=lambda err, msg: failures.append(err) if err else None)
    producer.flush(30)
    if failures:
        sys.exit(f"{len(failures)} tasks were not delivered: {failures[0]}")
    print(f"produced {count} tasks to {topic}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
