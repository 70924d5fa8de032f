"""The trainer's second reader of ``experiences``, for supervised rows mixed into RL batches (``trainer.mix``).

Why a reader of its own (consumer group ``<trainer group>.data``): the trainer's group commits the offsets it
has trained through, and the explorer paces on that group's lag. Supervised records (``streamrft data produce``)
sit between the RL experiences in every partition, often thousands of them written before the run. Were the RL
reader to hold them until batches take them, a few rows a step, its committed offsets would stay behind them,
its lag would count them, and the explorer would stop for a backlog that is not its to wait for. So the RL reader
passes over them and this reader, with positions of its own, takes them: SFT and DPO records only, and only as
many as the next batch needs (its pool stays small; the rest waits in the topic). Both readers' positions and
pools are in every checkpoint, so a resumed trainer trains each record once.

This reader sends no dead letters: the RL reader checks every record of the topic too and dead-letters the bad
ones, once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from streamrft.kafka.consumer import Delivered, Offsets, RecordConsumer
from streamrft.schemas import Experience, Objective, RolloutKind

from .group_buffer import Group, GroupBuffer

logger = logging.getLogger(__name__)

POLL_S = 0.2
FILL_BUDGET_S = 2.0  # the longest a batch waits for supervised rows that are not read yet; then it goes without
SUPERVISED = (Objective.SFT, Objective.DPO)


class SupervisedStream:
    """A pool of complete supervised groups per objective, read from ``experiences`` as batches need them."""

    def __init__(self, consumer: RecordConsumer, source: str):
        self.consumer = consumer
        self.source = source
        self.pools = {Objective.SFT: GroupBuffer(default_group_size=1),
                      Objective.DPO: GroupBuffer(default_group_size=2)}
        self._dry: set[Objective] = set()

    def __len__(self) -> int:
        return sum(len(pool) for pool in self.pools.values())

    # -- reading ----------------------------------------------------------------------------------------------
    def fill(self, wanted: dict[Objective, int], ends: Callable[[], Offsets]) -> None:
        """Read until the pools hold ``wanted`` complete groups of each objective, or this reader is at the
        topic's end (``ends()``, read once), or ``FILL_BUDGET_S`` has passed."""
        deadline = time.monotonic() + FILL_BUDGET_S
        end: Offsets | None = None
        while not self._holds(wanted) and time.monotonic() < deadline:
            end = end if end is not None else ends()
            if self._at(end):
                return
            # small polls keep the pool near what batches take (what is not polled waits in the topic)
            for item in self.consumer.poll(max_records=4 * sum(wanted.values()) + 32, timeout=POLL_S):
                self.add(item)

    def add(self, item: Delivered[Experience], now: float | None = None) -> None:
        record = item.record
        if record.kind != RolloutKind.TRAIN or record.objective not in SUPERVISED:
            return  # RL experiences are the trainer's other reader's
        if not self.pools[record.objective].add(item, now):
            logger.warning("%s: duplicate supervised experience %s at %s ignored", self.source, record.eid, item.where)

    def _holds(self, wanted: dict[Objective, int]) -> bool:
        return all(len(self.pools[o].complete_groups()) >= count for o, count in wanted.items())

    def _at(self, end: Offsets) -> bool:
        positions = self.consumer.fetch_positions()
        return all(positions.get(tp, 0) >= offset for tp, offset in end.items())

    # -- taking -----------------------------------------------------------------------------------------------
    def take(self, wanted: dict[Objective, int]) -> list[Group]:
        """Up to ``wanted`` complete groups of each objective, oldest first, out of the pools. An objective that
        has fewer is logged once per dry spell; the batch goes on with what there is."""
        taken = []
        for objective, count in wanted.items():
            groups = self.pools[objective].complete_groups()[:count]
            self.pools[objective].remove(groups)
            taken += groups
            if len(groups) < count and objective not in self._dry:
                self._dry.add(objective)
                logger.warning("%s: trainer.mix wants %d %s group(s) a batch and %d are read: batches go on with "
                               "fewer until more are produced (streamrft data produce)", self.source, count,
                               objective.value, len(groups))
            elif len(groups) == count:
                self._dry.discard(objective)
        return taken

    def expired(self, now: float, timeout_s: float) -> list[Group]:
        """Incomplete groups (a DPO pair missing a side) older than ``timeout_s``, out of the pools."""
        groups = []
        for pool in self.pools.values():
            stale = pool.expired(now, timeout_s)
            pool.remove(stale)
            groups += stale
        return groups

    # -- positions --------------------------------------------------------------------------------------------
    def trained_through(self) -> Offsets:
        """Per partition: the oldest pooled offset, else everything read (what this reader's group commits)."""
        offsets = self.consumer.positions()
        for pool in self.pools.values():
            for tp, offset in pool.low_water().items():
                offsets[tp] = min(offsets.get(tp, offset), offset)
        return offsets

    def items(self) -> list[Delivered[Experience]]:
        return [item for pool in self.pools.values() for item in pool.items()]
