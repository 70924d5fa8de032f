"""Which groups the trainer's next step trains, and when no more will come (steps 3 and the end of the trainer's
loop, ``role.py``). The run's shape (``streamrft/run_shape.py``) says which of two rules applies.

RL (with an explorer; ``trainer.mix`` adds its supervised rows to the batch afterwards): a batch is
``groups_per_train_step`` complete groups, oldest ``step`` first; a short batch once the explorer has finished
every step in the buffer and everything it wrote is read (failed or cancelled tasks leave a step with fewer
groups; waiting for them would deadlock ``fixed`` pacing). The stream is over once the explorer is done and everything it wrote is read.

Supervised alone (``mode: train``, no explorer): a batch is whole groups in the order read until it holds
``train_batch_size`` rows (a DPO pair is a group of two); a short one at the data's end, which is where the topic
ended when the trainer started (none with ``trainer.total_steps``: then it trains data produced while it runs).
"""
from __future__ import annotations

from dataclasses import dataclass

from streamrft.config import RunConfig
from streamrft.errors import ConfigError
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Offsets, RecordConsumer
from streamrft.sync import SyncView
from .group_buffer import Group, GroupBuffer


@dataclass
class _EndWatch:
    """End offsets of ``experiences`` read right after the explorer reported (finished_step, done): once the
    trainer's positions reach them, every experience of those steps has been read."""

    key: tuple[int, bool]
    ends: Offsets


class BatchPicker:
    """Picks batches from the trainer's group buffer, and says when the stream it reads is over."""

    def __init__(self, config: RunConfig, buffer: GroupBuffer, consumer: RecordConsumer, clients: KafkaClients,
                 sync: SyncView):
        self.supervised_alone = config.shape.trainer_reads_supervised_only
        self.rows_per_step = config.train_batch_size
        self.groups_per_step = config.groups_per_train_step
        self.total_steps = config.trainer.total_steps
        self.topic = config.topic("experiences")
        self.buffer = buffer
        self.consumer = consumer
        self.clients = clients
        self.sync = sync
        self._data_end: Offsets | None = None
        self._end_watch: _EndWatch | None = None

    def start(self) -> None:
        """Once the reader is assigned: supervised alone without total_steps, the data to train is what the topic
        holds now."""
        if not self.supervised_alone or self.total_steps is not None:
            return
        ends = self.clients.offsets(self.topic, "end")
        if not any(ends.values()):
            raise ConfigError(f"mode train: {self.topic} is empty, and without trainer.total_steps the "
                              "trainer trains what the topic holds when it starts; produce the data first "
                              "(streamrft data produce FILE --as sft|dpo) or set trainer.total_steps")
        self._data_end = ends

    def ready(self) -> bool:
        """A full batch is buffered."""
        complete = self.buffer.complete_groups()
        if self.supervised_alone:
            return sum(len(g.items) for g in complete) >= self.rows_per_step
        return len(complete) >= self.groups_per_step

    def next(self) -> list[Group] | None:
        """The groups of the next step, or None while it must wait for more."""
        complete = self.buffer.complete_groups()
        if self.supervised_alone:
            return self._supervised(complete)
        if len(complete) >= self.groups_per_step:
            return complete[: self.groups_per_step]
        if complete and self._short_batch_allowed():
            return complete
        return None

    def short(self, groups: list[Group]) -> bool:
        if self.supervised_alone:
            return sum(len(g.items) for g in groups) < self.rows_per_step
        return len(groups) < self.groups_per_step

    def everything_read(self) -> bool:
        """No more records will come: the explorer is done and all it wrote is read, or (supervised alone) the
        data is read to its end."""
        if self.supervised_alone:
            return self._read_to_data_end()
        return self.sync.explorer.done and self._read_everything_written()

    def _supervised(self, complete: list[Group]) -> list[Group] | None:
        batch, rows = [], 0
        for group in complete:
            if rows >= self.rows_per_step:
                break
            batch.append(group)
            rows += len(group.items)
        if rows >= self.rows_per_step or (batch and self._read_to_data_end()):
            return batch
        return None

    def _read_to_data_end(self) -> bool:
        if self._data_end is None:  # with trainer.total_steps: never
            return False
        positions = self.consumer.fetch_positions()
        return all(positions.get(tp, 0) >= end for tp, end in self._data_end.items())

    def _short_batch_allowed(self) -> bool:
        """The explorer has finished every step it published (or is done), all it wrote is read, and no
        buffered group is still incomplete: no more groups can come. A step still in flight will bring groups
        that fill the batch (under fully_async a batch takes groups of several steps in the order read: one
        finished step's leftover group alone is no reason to train short)."""
        explorer = self.sync.explorer
        in_flight = not explorer.done and explorer.next_step - 1 > explorer.finished_step
        if in_flight or explorer.finished_step < self.buffer.max_step() or self.buffer.incomplete_groups():
            return False
        return self._read_everything_written()

    def _read_everything_written(self) -> bool:
        """True once our positions reach the end offsets read after the explorer's latest progress report."""
        explorer = self.sync.explorer
        key = (explorer.finished_step, explorer.done)
        if self._end_watch is None or self._end_watch.key != key:
            self._end_watch = _EndWatch(key, self.clients.offsets(self.topic, "end"))
        positions = self.consumer.fetch_positions()
        return all(positions.get(tp, 0) >= end for tp, end in self._end_watch.ends.items())
