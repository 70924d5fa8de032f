"""Before a step trains them: a DPO group whose records are not one preference pair (each record passed its own
check) is dead-lettered whole, with the reason."""
from __future__ import annotations

import logging

from streamrft.engines.training.supervised import pair_problem
from streamrft.kafka.dlq import dead_letter
from streamrft.runtime import UnitOfWork
from streamrft.schemas import Objective, SingleObjectCodec

from .group_buffer import Group
from .metrics import TrainerMetrics

logger = logging.getLogger(__name__)


class PairCheck:
    def __init__(self, consumer_group: str, source: str, metrics: TrainerMetrics):
        self.consumer_group = consumer_group
        self.source = source
        self.metrics = metrics
        self.codec = SingleObjectCodec()  # a dead letter's value: the record's registry-independent bytes

    def fit(self, groups: list[Group], unit: UnitOfWork) -> list[Group]:
        """The groups fit to train; the others' records go to the dead-letter topic with the unit."""
        fit = []
        for group in groups:
            problem = pair_problem(group.experiences) if group.objective == Objective.DPO else None
            if problem is None:
                fit.append(group)
                continue
            logger.warning("%s: DPO group %s dead-lettered: %s", self.source, group.group_id, problem)
            self.metrics.drop("bad-pair", len(group.items))
            for item in group.items.values():
                unit.dead_letter(dead_letter(
                    topic=item.topic, partition=item.partition, offset=item.offset,
                    key=None if item.key is None else item.key.encode(), value=self.codec.encode(item.record),
                    error=f"DPO group {group.group_id}: {problem}", reason="bad-pair", stage="process",
                    group=self.consumer_group, original_headers=item.headers))
        return fit
