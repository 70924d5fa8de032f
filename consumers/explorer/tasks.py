"""The ``tasks`` topic as the explorer reads it: blocks of ``batch_size × selector.block_steps`` tasks put in the
selector's order, epochs (the topic is read again from its start, ``total_epochs`` times; ``null`` streams), and
the pending tasks of the state record.

The committed ``tasks`` offset is the taskset position. A block read but not yet rolled out is referenced in the
explorer's state record (``pending``: ``[epoch, partition, offset]`` in rollout order; the record never embeds
a task, so it stays small whatever the prompts), and every transaction of the explorer writes that record with
the offsets: a task is either still in the topic, pending in the record, or published, never lost or doubled. A
restarted explorer reads the pending tasks back by reference (:meth:`TaskSource.restore`)."""
from __future__ import annotations

import logging
import time

from streamrft.config import RunConfig
from streamrft.kafka import KafkaClients, RecordConsumer
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.schemas import Task
from streamrft.selection import Selector
from streamrft.validation import ExplorerState

logger = logging.getLogger(__name__)

POLL_S = 0.5


class TaskSource:
    def __init__(self, config: RunConfig, clients: KafkaClients, consumer: RecordConsumer[Task],
                 selector: Selector, stop: StopSignal, source: str) -> None:
        self.config = config
        self.settings = config.explorer
        self.clients = clients
        self.consumer = consumer
        self.selector = selector
        self.stop = stop
        self.source = source
        self.state = ExplorerState()
        self.exhausted = False  # the last epoch's tasks are all taken
        # (epoch, partition, offset) -> task, for the references in state.pending (a block that spans an epoch
        # boundary of a small topic can hold one record twice)
        self._by_ref: dict[tuple[int, int, int], Task] = {}

    def ready(self, wait: bool) -> bool:
        """The state's pending tasks hold a step (reading the next block when they are empty). ``wait=False``
        (streaming with rounds in flight, whose results must be collected meanwhile): an empty topic is not
        waited on."""
        if not self.state.pending:
            self._read_block(wait=wait)
        if self.state.pending:
            return True
        if self.settings.total_epochs is not None:
            self.exhausted = True  # the last epoch is rolled out
        return False

    def take(self) -> list[tuple[int, Task]]:
        """The next step's (epoch, task) pairs; a block can span an epoch boundary."""
        if not self.state.pending:
            self._read_block()
        size = self.settings.batch_size
        refs, self.state.pending = self.state.pending[:size], self.state.pending[size:]
        return [(ref[0], self._by_ref.pop(tuple(ref))) for ref in refs]

    def _read_block(self, wait: bool = True) -> None:
        """Fill the state's pending list with the next block of tasks, in the selector's order. Streaming
        (``total_epochs: null``) with ``wait=False``, an empty topic returns at once with no block."""
        s = self.settings
        want = s.batch_size * s.selector.block_steps
        block: list[tuple[int, Delivered[Task]]] = []
        idle_since = time.monotonic()
        while len(block) < want and not self.stop.requested:
            items = self.consumer.poll(max_records=want - len(block), timeout=POLL_S)
            block += [(self.state.epoch, item) for item in items]
            if items:
                idle_since = time.monotonic()
                continue
            if not self.consumer.at_end():
                continue  # still fetching
            if s.total_epochs is None:  # streaming: wait for injected tasks; roll out a partial block when idle
                if not block and not wait or block and time.monotonic() - idle_since > s.idle_wait_s:
                    break
                continue
            if self.state.epoch + 1 >= s.total_epochs:
                break  # the last epoch is exhausted (a partial block, or none)
            self.state.epoch += 1
            logger.info("explorer: end of tasks; epoch %d starts", self.state.epoch)
            self.consumer.rewind_to_start()
        by_task = {id(item.record): (epoch, item) for epoch, item in block}
        ordered = self.selector.order([item.record for _, item in block], self.state.epoch,
                                      self.state.next_step // s.selector.block_steps)
        self.state.pending = []
        for task in ordered:
            epoch, item = by_task[id(task)]
            self.state.pending.append([epoch, item.partition, item.offset])
            self._by_ref[(epoch, item.partition, item.offset)] = task

    # -- after a restart ------------------------------------------------------------------------------------
    def restore(self, state: ExplorerState) -> None:
        """Take over the state record's epoch and pending references, and read those tasks back from ``tasks``
        (group-less). A task no longer there (retention) or no longer valid is skipped, with a warning."""
        self.state = state
        wanted = {(partition, offset) for _, partition, offset in state.pending}
        if not wanted:
            return
        topic = self.config.topic("tasks")
        found = self._read_at(topic, wanted)
        lost = [ref for ref in state.pending if (ref[1], ref[2]) not in found]
        if lost:
            logger.warning("explorer: %d pending task(s) are no longer readable on %s (retention?) and are "
                           "skipped: %s", len(lost), topic, ", ".join(f"[{p}]@{o}" for _, p, o in lost[:10]))
        state.pending = [ref for ref in state.pending if ref not in lost]
        for epoch, partition, offset in state.pending:
            self._by_ref[(epoch, partition, offset)] = found[(partition, offset)]

    def _read_at(self, topic: str, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], Task]:
        reader = self.clients.consumer([topic], Task, self.config.consumer_group("explorer-restore"),
                                       client_id=f"{self.source}-restore", subscribe=False, dead_letters=False,
                                       extra={"enable.partition.eof": True})
        found: dict[tuple[int, int], Task] = {}
        try:
            starts: dict[tuple[str, int], int] = {}
            for partition, offset in wanted:
                starts[(topic, partition)] = min(offset, starts.get((topic, partition), offset))
            reader.assign(starts)
            deadline = time.monotonic() + 60
            while len(found) < len(wanted) and not reader.at_end() and time.monotonic() < deadline:
                for item in reader.poll(max_records=500, timeout=POLL_S):
                    if (item.partition, item.offset) in wanted:
                        found[(item.partition, item.offset)] = item.record
        finally:
            reader.close()
        return found
