"""What the trainer commits of its readers' positions, and when: after each step, and between steps what it read
past without training (step 6 of the loop, ``role.py``). The committed offsets tell the explorer how much is
untrained (it paces on this group's lag) and an operator where the trainer is; resuming uses the checkpoint's.
Every commit goes through :class:`GroupOffsets`, which first checks that no one else moved the group."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from streamrft.kafka.consumer import Offsets, RecordConsumer
from streamrft.runtime import UnitOfWork

from .group_buffer import GroupBuffer
from .group_offsets import GroupOffsets
from .mix import SupervisedMix

logger = logging.getLogger(__name__)

RELEASE_INTERVAL_S = 1.0


class TrainedOffsets:
    def __init__(self, consumer: RecordConsumer, buffer: GroupBuffer, mix: SupervisedMix | None, *, source: str,
                 accept_reset: bool, checkpoint_step: Callable[[], int]):
        self.consumer = consumer
        self.buffer = buffer
        self.mix = mix
        self.source = source
        self.checkpoint_step = checkpoint_step  # the newest checkpoint's step: a reset accepted goes on from it
        self.group = GroupOffsets(consumer, accept=accept_reset, on_accepted=self._read_on_from)
        self._released: Offsets = {}  # the offsets release() committed last, and when
        self._released_at = 0.0

    def after_step(self, unit: UnitOfWork, step: int) -> None:
        """After the unit's transaction: each reader's trained-through offsets (the RL reader's pace the
        explorer)."""
        offsets = self.trained_through()
        unit.after_commit(lambda: self.group.commit(offsets, step, self.checkpoint_step()))
        if self.mix is not None:
            self.mix.commit_offsets(unit)

    def release(self, unit: UnitOfWork, step: int) -> None:
        """Between steps, commit how far this reader has read past what it does not train (the supervised rows of
        trainer.mix, often thousands written before the run): the explorer paces on this group's lag, and would
        otherwise wait for a backlog this trainer never takes (at most once a second; it changes no position a
        resume uses, which are the checkpoint's). Unchanged, the group's offsets are read back instead: an idle
        trainer notices a reset too, which would otherwise hold the explorer on a lag no one trains."""
        now = time.monotonic()
        if now - self._released_at < RELEASE_INTERVAL_S:
            return
        self._released_at = now
        offsets = self.trained_through()
        if offsets != self._released:
            self._released = offsets
            unit.after_commit(lambda: self.group.commit(offsets, step, self.checkpoint_step()))
        else:
            self.group.check(self.checkpoint_step())

    def trained_through(self) -> Offsets:
        """Per partition: the oldest buffered offset, else everything read, up to the consumer's own position:
        past the aborted records and transaction markers behind the last record, which no one ever trains. The
        explorer paces on this group's lag; counted up to them, a broker failover's aborted attempts held it for
        good (a 3-node chaos run stalled on a "lag" of 251 with every experience trained)."""
        offsets = self.consumer.fetch_positions()
        offsets.update(self.buffer.low_water())
        return offsets

    def forget_released(self) -> None:
        """The positions went back to a checkpoint's: the next release commits whatever it finds."""
        self._released = {}

    def _read_on_from(self, offsets: Offsets) -> None:
        """A reset accepted while running: what the buffer holds of those partitions goes, and the reader reads on
        from the group's offsets (the others from where they were)."""
        dropped = self.buffer.drop_partitions(set(offsets))
        self.consumer.assign({**self.consumer.positions(), **offsets})
        self._released = {}
        logger.warning("%s: reading on from %s; %d buffered experience(s) of those partitions dropped (read "
                       "again from there)", self.source,
                       ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(offsets.items())), dropped)
