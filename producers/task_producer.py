"""Produce Task records to a run's ``tasks`` topic, with progress and an exact account of what was rejected."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

from streamrft.schemas import Task
from streamrft.kafka import RecordProducer
from .task_files import Rejected

logger = logging.getLogger(__name__)


@dataclass
class ProduceSummary:
    produced: int = 0
    rejected: list[Rejected] = field(default_factory=list)


def produce_tasks(producer: RecordProducer, topic: str, items: Iterable[Task | Rejected],
                  on_item: Callable[[], None] | None = None, flush_every: int = 10_000) -> ProduceSummary:
    """Produce every Task in ``items`` and collect every Rejected row; all deliveries are confirmed (flush)
    before returning, so ``produced`` counts records the broker acknowledged."""
    summary = ProduceSummary()
    pending = 0
    for item in items:
        if isinstance(item, Rejected):
            summary.rejected.append(item)
        else:
            producer.produce(topic, item)
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
