"""The run's topics, declared once: :data:`TOPIC_KINDS` says for each kind of topic its record type, its key, which
roles write and read it, which roles dead-letter what they read from it, and its default layout. Everything else
is derived from it: the ``topics:`` config section (:class:`TopicsConfig`), the topic names, the dead-letter
topics, the ACLs of each role's principal (``streamrft/acls.py``), the Strimzi ``KafkaTopic`` manifests and the
``streamrft tail`` choices.

Adding a topic kind (docs/architecture.md, "Adding a topic kind", has the whole list; ``tests/unit/
test_topic_kinds.py`` fails naming any place that was missed):
1. an entry in :data:`TOPIC_KINDS`;
2. its record type in ``schemas/records.py`` (``RECORD_TYPES``, with its ``.avsc`` file) if it is a new one;
3. the check of what it holds in ``streamrft/validation.py`` (``TOPIC_CHECKS``), which every reader applies;
4. the code of the roles that write and read it (``config.topic("<name>")``);
5. its row in docs/architecture.md's topic table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from streamrft.schemas import (Experience, FeedbackReceipt, Metric, Record, RolloutRequest, RolloutResult, SyncSignal,
                               Task)

from .base import Section

_DAY_MS = 24 * 3600 * 1000


class TopicConfig(Section):
    """Layout of one topic. ``None`` leaves a setting to the broker's default."""

    partitions: int = Field(default=1, ge=1, description="the topic's partitions: the most consumers of one group "
                                                         "that get work; raise it before adding readers")
    replication_factor: int = Field(default=-1, description="copies of each partition; -1 = the broker's "
                                                            "default.replication.factor")
    retention_ms: int | None = Field(default=None, ge=-1, description="Kafka retention.ms: how long records are "
                                                                      "kept; -1 = forever, none = the broker's default")
    max_message_bytes: int | None = Field(default=None, ge=1024,
                                          description="Kafka max.message.bytes: the largest record batch the topic "
                                                      "takes; none = the broker's default")
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = Field(
        default="delete", description="Kafka cleanup.policy: delete old segments by time, compact to the latest "
                                      "record per key, or both")

    @field_validator("replication_factor")
    @classmethod
    def _rf(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("replication_factor must be -1 (broker default) or at least 1")
        return value

    def kafka_config(self) -> dict[str, str]:
        """Topic-level configs as the admin API takes them."""
        out = {"cleanup.policy": self.cleanup_policy}
        if self.retention_ms is not None:
            out["retention.ms"] = str(self.retention_ms)
        if self.max_message_bytes is not None:
            out["max.message.bytes"] = str(self.max_message_bytes)
        return out


@dataclass(frozen=True)
class TopicKind:
    name: str
    record: type[Record]
    key: str  # what the record key is
    writers: tuple[str, ...]  # roles (streamrft/acls.py ROLES) that produce to it
    readers: tuple[str, ...]  # roles that consume it
    dead_letters: tuple[str, ...]  # roles that dead-letter what they read from it (they write and read its DLQ)
    layout: TopicConfig
    ordered: bool = False  # one partition, so that its records are read in the order written
    doc: str = ""


# The roles that follow the trainer's and the explorer's signals.
FOLLOWERS = ("explorer", "rollout", "trainer", "serve")
# Every role but the task producer and the read-only viewer publishes metrics.
METRIC_WRITERS = ("explorer", "rollout", "trainer", "monitor", "serve")

TOPIC_KINDS: tuple[TopicKind, ...] = (
    TopicKind("tasks", Task, "task_id", writers=("tasks",), readers=("explorer",), dead_letters=("explorer",),
              layout=TopicConfig(partitions=1),
              doc="the taskset; producers inject at any time; the explorer's committed offset is its position"),
    TopicKind("rollouts", RolloutRequest, "request_id", writers=("explorer",), readers=("rollout",),
              dead_letters=("rollout",), layout=TopicConfig(partitions=16),
              doc="one request per task per step; partitions >= the most rollout workers"),
    TopicKind("experiences", Experience, "group_id", writers=("rollout", "serve"), readers=("trainer",),
              dead_letters=("trainer",), layout=TopicConfig(partitions=8, max_message_bytes=16 * 1024 * 1024),
              doc="one record per sampled response; one GRPO group per key, so a group arrives together"),
    TopicKind("results", RolloutResult, "request_id", writers=("rollout",), readers=("explorer",),
              dead_letters=("explorer",), layout=TopicConfig(partitions=4),
              doc="a request's light outcome, so the explorer finishes steps without reading experiences"),
    # The two signal topics are apart so that ACLs tell who may write which: only the trainer publishes weights,
    # only the explorer writes its state and cancels steps. Compacted (the latest signal per key) with time
    # retention as well.
    TopicKind("sync", SyncSignal, "policy.<kind>", writers=("trainer",), readers=FOLLOWERS,
              dead_letters=("explorer", "rollout", "serve"), ordered=True,
              layout=TopicConfig(partitions=1, cleanup_policy="compact,delete", retention_ms=7 * _DAY_MS),
              doc="the trainer's signals: weights published, sync requests, the weight-sync group"),
    TopicKind("control", SyncSignal, "policy.<kind>", writers=("explorer",), readers=FOLLOWERS,
              dead_letters=("explorer",), ordered=True,
              layout=TopicConfig(partitions=1, cleanup_policy="compact,delete", retention_ms=7 * _DAY_MS),
              doc="the explorer's signals: its state record, cancelled steps"),
    TopicKind("metrics", Metric, "source", writers=METRIC_WRITERS, readers=("monitor",), dead_letters=("monitor",),
              layout=TopicConfig(partitions=1), doc="scalar metrics of every role, with step and role"),
    TopicKind("feedback", FeedbackReceipt, "<response_id>/<choice>", writers=("serve",), readers=("serve",),
              dead_letters=("serve",),
              layout=TopicConfig(partitions=1, cleanup_policy="compact,delete", retention_ms=7 * _DAY_MS),
              doc="serve mode's receipts: what each acknowledged feedback wrote, so a retry writes nothing twice"),
)
DLQ_LAYOUT = TopicConfig(partitions=1, retention_ms=30 * _DAY_MS)

TOPIC_NAMES: tuple[str, ...] = tuple(kind.name for kind in TOPIC_KINDS)
KINDS_BY_NAME: dict[str, TopicKind] = {kind.name: kind for kind in TOPIC_KINDS}


class _TopicsBase(Section):
    @model_validator(mode="before")
    @classmethod
    def _over_each_topics_defaults(cls, data: Any) -> Any:
        """``sync: {replication_factor: 3}`` changes that key only: the rest keeps the topic's own defaults
        (its compaction, its partitions), not TopicConfig's."""
        if not isinstance(data, dict):
            return data
        merged = {}
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is not None and isinstance(value, dict):
                value = {**field.default.model_dump(), **value}
            merged[name] = value
        return merged

    @field_validator(*(kind.name for kind in TOPIC_KINDS if kind.ordered), check_fields=False)
    @classmethod
    def _ordered_topics_have_one_partition(cls, value: TopicConfig, info) -> TopicConfig:
        if value.partitions != 1:
            raise ValueError(f"topics.{info.field_name}.partitions must be 1: its records must be read in order")
        return value


TopicsConfig = create_model(
    "TopicsConfig", __base__=_TopicsBase, __doc__="``topics:``: each topic's layout (defaults: TOPIC_KINDS).",
    **{kind.name: (TopicConfig, Field(default=kind.layout, description=f"layout of the {kind.name} topic: {kind.doc}"))
       for kind in TOPIC_KINDS},
    dlq=(TopicConfig, Field(default=DLQ_LAYOUT, description="layout of every dead-letter topic (<topic>.dlq): the "
                                                            "records a role could not read, each with its reason")))
