"""Produce records (Task records to a run's ``tasks`` topic, supervised experiences to ``experiences``), with
progress and an exact account of what was rejected."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

from streamrft.schemas import Record, Task
from streamrft.kafka import RecordProducer
from .task_files import Rejected

logger = logging.getLogger(__name__)


@dataclass
class ProduceSummary:
    produced: int = 0  # records acknowledged by the broker
    rejected: list[Rejected] = field(default_factory=list)


def produce_records(producer: RecordProducer, topic: str, items: Iterable[Record | list[Record] | Rejected],
                    on_item: Callable[[], None] | None = None, flush_every: int = 10_000) -> ProduceSummary:
    """Produce every record in ``items`` and collect every Rejected row; all deliveries are confirmed (flush)
    before returning, so ``produced`` counts records the broker acknowledged. An item that is a list is one
    row's records (a DPO pair), produced back to back: with one key they land in one partition, in order.
    ``on_item`` is called once per item (a row of the source)."""
    summary = ProduceSummary()
    pending = 0
    for item in items:
        if isinstance(item, Rejected):
            summary.rejected.append(item)
        else:
            for record in item if isinstance(item, list) else [item]:
                producer.produce(topic, record)
                pending += 1
            if pending >= flush_every:
                producer.flush()
                summary.produced += pending
                pending = 0
        if on_item is not None:
            on_item()
    producer.flush()
    summary.produced += pending
    return summary


def produce_tasks(producer: RecordProducer, topic: str, items: Iterable[Task | Rejected],
                  on_item: Callable[[], None] | None = None, flush_every: int = 10_000) -> ProduceSummary:
    """Produce the tasks of a task file (:func:`produce_records`)."""
    return produce_records(producer, topic, items, on_item, flush_every)
