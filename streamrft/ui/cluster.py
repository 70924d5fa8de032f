"""What the UI asks the cluster, through the client layer: the run's topics, its consumer groups and their lag,
the last records of a topic, the dead letters. One lock serialises the calls: the pages (FastAPI's thread pool)
and the lag sampler share one probe consumer and the offsets readers."""
from __future__ import annotations

import threading

from ..config import RunConfig
from ..kafka import KafkaClients
from ..kafka.dlq import dlq_topic_of
from ..kafka.inspection import GroupState, TopicState, describe_groups, describe_topics, read_last, topic_names
from .records import ShownRecord, shown

DLQ_SUFFIX = dlq_topic_of("")


class ClusterView:
    def __init__(self, config: RunConfig, clients: KafkaClients):
        self.config = config
        self.clients = clients
        self._lock = threading.Lock()

    @property
    def topic_prefix(self) -> str:
        return self.config.topic_prefix

    @property
    def group_prefix(self) -> str:
        return f"{self.config.name}."

    def short(self, topic: str) -> str:
        """``rft.<run>.tasks`` -> ``tasks``: the run's topics by the names the config gives them."""
        return topic.removeprefix(self.topic_prefix)

    def topic_names(self) -> list[str]:
        with self._lock:
            return topic_names(self.clients.admin(), self.topic_prefix)

    def topics(self) -> list[TopicState]:
        with self._lock:
            admin = self.clients.admin()
            return describe_topics(admin, self.clients.probe(), topic_names(admin, self.topic_prefix))

    def groups(self) -> list[GroupState]:
        with self._lock:
            admin = self.clients.admin()
            topics = describe_topics(admin, self.clients.probe(), topic_names(admin, self.topic_prefix))
            return describe_groups(admin, self.clients.offsets_reader, topics, self.group_prefix,
                                   self.clients.count_records)

    def records(self, topic: str, per_partition: int, key: str | None = None) -> list[ShownRecord]:
        """The last records of ``topic`` decoded; with ``key``, those whose key contains it."""
        keep = (lambda raw: True) if not key else (lambda raw: raw.key is not None and key.encode() in raw.key)
        found = read_last(self.config.kafka, self.clients.bootstrap, topic, per_partition, keep)
        return [shown(raw, self.clients.serde) for raw in found]

    def dlq_topics(self) -> list[str]:
        return [name for name in self.topic_names() if name.endswith(DLQ_SUFFIX)]
