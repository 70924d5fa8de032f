"""A taskset fed through a topic (``tasks``, or ``tasks.<name>``) as the explorer reads it: blocks of
``batch_size × block_steps`` tasks put in the taskset's order, epochs (the topic is read again from its start;
``null`` epochs stream), and the pending tasks of the state record.

The committed offsets of its topic are the taskset's position. A block read but not yet rolled out is referenced in
the explorer's state record (its ``pending``: ``[epoch, partition, offset]`` in rollout order; the record never
embeds a task, so it stays small whatever the prompts), and every transaction of the explorer writes that record
with the offsets: a task is either still in the topic, pending in the record, or published, never lost or
doubled. A restarted explorer reads the pending tasks back by reference (:meth:`TopicTaskset.restore`).

Several topic-fed tasksets share the explorer's one bound consumer (one transaction commits every position):
each reads only its own topic while it reads (``RecordConsumer.read_only``).

**Task ids in a block are unique.** A record whose ``task_id`` another record of the same block already has is
not rolled out: it is dead-lettered (``duplicate task_id (first at partition P offset O)``) with the transaction
that moves past it. The same id in a later block is a task injected again, and is rolled out again.

**A task keeps the ``taskset`` its producer wrote.** In a run without ``explorer.tasksets`` (one taskset, the
``tasks`` topic) the field is the producer's label and goes to the request and its result as written. With
``explorer.tasksets``, a topic is one taskset's and its results are counted by that name: a record naming another
taskset is dead-lettered (``taskset-mismatch``, saying which name its topic takes), never renamed. A taskset's own
``workflow`` / ``reward_fn`` settings do replace the task's (that is what they are for), so its payload is checked
again against the schemas of what will run it (``bad-payload``, naming the key).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time

from streamrft.config import RunConfig, TasksetConfig
from streamrft.kafka import KafkaClients, RecordConsumer
from streamrft.kafka.consumer import Delivered
from streamrft.kafka.dlq import DeadLetter, dead_letter
from streamrft.lifecycle import StopSignal
from streamrft.schemas import SingleObjectCodec, Task
from streamrft.schemas.payload_contract import PayloadError, check_payload
from streamrft.selection import Selector

logger = logging.getLogger(__name__)

POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Refused:
    """A task record read that is not rolled out: ``reason`` is the DLQ's tag, ``detail`` says why and what to do."""

    item: Delivered[Task]
    reason: str
    detail: str

    def letter(self, group: str) -> DeadLetter:
        item = self.item
        return dead_letter(topic=item.topic, partition=item.partition, offset=item.offset,
                           key=None if item.key is None else item.key.encode(),
                           value=SingleObjectCodec().encode(item.record), error=self.detail,
                           reason=self.reason, stage="process", group=group, original_headers=item.headers)


class TopicTaskset:
    def __init__(self, config: RunConfig, clients: KafkaClients, consumer: RecordConsumer[Task],
                 taskset: TasksetConfig, selector: Selector, block_steps: int, stop: StopSignal, source: str) -> None:
        self.config = config
        self.settings = config.explorer
        self.taskset = taskset
        self.name = taskset.name
        self.topic = config.topic_prefix + taskset.topic_suffix
        self.epochs = taskset.epochs or self.settings.total_epochs
        self.clients = clients
        self.consumer = consumer
        self.selector = selector
        self.block_steps = block_steps
        self.stop = stop
        self.source = source
        self.epoch = 0
        self.pending: list[list[int]] = []  # [epoch, partition, offset] read, not yet rolled out, in order
        self.blocks = 0  # blocks read so far (a shuffled block's seed: a restart orders the next one the same)
        self.exhausted = False  # the last epoch's tasks are all taken
        self.skipped = 0  # solved tasks passed over (order difficulty, skip_solved)
        # (epoch, partition, offset) -> task, for the references in pending (a block that spans an epoch boundary
        # of a small topic can hold one record twice)
        self._by_ref: dict[tuple[int, int, int], Task] = {}
        self.refused: list[Refused] = []  # read, not to be rolled out: for the dead-letter topic
        # with explorer.tasksets, a task's taskset must be this one's name; without, it is the producer's label
        self.named = bool(config.explorer.tasksets)
        self._refused_at: set[str] = set()  # where (topic[partition]@offset) of the records refused so far

    # -- the schedule's calls -------------------------------------------------------------------------------
    def ready(self, wait: bool) -> bool:
        """Tasks are pending (reading the next block when there are none). ``wait=False`` (streaming with rounds
        in flight, whose results must be collected meanwhile): an empty topic is not waited on."""
        if not self.pending and not self.exhausted:
            self._read_block(wait=wait)
        if self.pending:
            return True
        if self.epochs is not None:
            self.exhausted = True  # the last epoch is rolled out
        return False

    def take(self, count: int) -> list[tuple[int, Task]]:
        """Up to ``count`` (epoch, task) pairs, the next in order (a block can span an epoch boundary); fewer
        only when the taskset runs out."""
        taken: list[tuple[int, Task]] = []
        # a streaming topic is waited on for the step's first task only: then what is there makes the step
        while len(taken) < count and self.ready(wait=not taken):
            ref = self.pending.pop(0)
            task = self._by_ref.pop(tuple(ref))
            if self.taskset.order.skip_solved and self.selector.solved(task.task_id):
                self.skipped += 1
                continue
            taken.append((ref[0], self._as_mine(task)))
        return taken

    def position(self) -> dict:
        return {"epoch": self.epoch, "pending": [list(ref) for ref in self.pending], "blocks": self.blocks}

    def observe(self, result) -> None:
        self.selector.observe(result)

    def _as_mine(self, task: Task) -> Task:
        """The task with this taskset's settings (its ``taskset`` is the producer's, checked in ``_refusal``)."""
        t = self.taskset
        if not (t.workflow or t.reward_fn or t.repeat_times):
            return task
        return dataclasses.replace(task, workflow=t.workflow or task.workflow, reward_fn=t.reward_fn or task.reward_fn,
                                   repeat_times=t.repeat_times or task.repeat_times)

    def _refusal(self, item: Delivered[Task]) -> Refused | None:
        """Why ``item`` is not rolled out by this taskset, or None (module docstring)."""
        task = item.record
        if self.named and task.taskset != self.name:
            return Refused(item, "taskset-mismatch", (
                f"task {task.task_id!r} names taskset {task.taskset!r}, but {self.topic} feeds taskset {self.name!r} "
                f"(explorer.tasksets): set the record's taskset to {self.name!r}, or produce it to the topic of "
                f"its own taskset (`streamrft tasks produce FILE --taskset {task.taskset}`); the explorer counts "
                "a task's results by the taskset it names and never renames one"))
        if self.taskset.workflow or self.taskset.reward_fn:
            mine = self._as_mine(task)
            try:
                check_payload(mine.workflow, mine.reward_fn, json.loads(mine.payload or "{}"))
            except PayloadError as exc:
                return Refused(item, "bad-payload", (
                    f"task {task.task_id!r}: {exc}; taskset {self.name!r} runs its tasks with workflow "
                    f"{mine.workflow!r} and reward {mine.reward_fn or 'the workflow default'!r}"))
        return None

    def _read_block(self, wait: bool = True) -> None:
        """Fill ``pending`` with the next block of tasks, in the selector's order. Streaming (``epochs`` null)
        with ``wait=False``, an empty topic returns at once with no block."""
        s = self.settings
        want = s.batch_size * self.block_steps
        block: list[tuple[int, Delivered[Task]]] = []
        idle_since = time.monotonic()
        self.consumer.read_only(self.topic)
        while len(block) < want and not self.stop.requested:
            items = self.consumer.poll(max_records=want - len(block), timeout=POLL_S)
            strays = [item.where for item in items if item.topic != self.topic]
            if strays:  # a paused topic delivers nothing (librdkafka purges what it fetched); its offsets moved
                raise RuntimeError(f"taskset {self.name}: read records of another taskset's topic: {strays[:3]}")
            block += [(self.epoch, item) for item in items]
            if items:
                idle_since = time.monotonic()
                continue
            if not self.consumer.at_end(self.topic):
                continue  # still fetching
            if self.epochs is None:  # streaming: wait for injected tasks; roll out a partial block when idle
                if not block and not wait or block and time.monotonic() - idle_since > s.idle_wait_s:
                    break
                continue
            if self.epoch + 1 >= self.epochs:
                break  # the last epoch is exhausted (a partial block, or none)
            self.epoch += 1
            logger.info("explorer: end of taskset %s (%s); epoch %d starts", self.name, self.topic, self.epoch)
            self.consumer.rewind_to_start(topic=self.topic)
        block = self._without_refused(self._without_duplicates(block))
        by_task = {id(item.record): (epoch, item) for epoch, item in block}
        ordered = self.selector.order([item.record for _, item in block], self.epoch, self.blocks)
        self.blocks += 1
        self.pending = []
        for task in ordered:
            epoch, item = by_task[id(task)]
            self.pending.append([epoch, item.partition, item.offset])
            self._by_ref[(epoch, item.partition, item.offset)] = task

    def _without_duplicates(self, block: list[tuple[int, Delivered[Task]]]) -> list[tuple[int, Delivered[Task]]]:
        """The block less the records whose task id an earlier record of it has (those go to ``refused``).
        One record read twice (a block across an epoch boundary of a small topic) is not a duplicate."""
        first_at: dict[str, tuple[int, int]] = {}
        kept = []
        for epoch, item in block:
            first = first_at.setdefault(item.record.task_id, (item.partition, item.offset))
            if first == (item.partition, item.offset):
                kept.append((epoch, item))
            else:
                self.refused.append(Refused(item, "duplicate-task-id", (
                    f"duplicate task_id {item.record.task_id!r} (first at partition {first[0]} offset {first[1]}); "
                    "give each task its own id, or inject it again later to roll it out again")))
                logger.warning("explorer: %s: duplicate task_id %r (first at partition %d offset %d) is "
                               "dead-lettered", item.where, item.record.task_id, *first)
        return kept

    def _without_refused(self, block: list[tuple[int, Delivered[Task]]]) -> list[tuple[int, Delivered[Task]]]:
        kept = []
        for epoch, item in block:
            refused = self._refusal(item)
            if refused is None:
                kept.append((epoch, item))
            elif item.where not in self._refused_at:  # read again in a later epoch: dead-lettered once
                self._refused_at.add(item.where)
                self.refused.append(refused)
                logger.warning("explorer: %s is dead-lettered: %s", item.where, refused.detail)
        return kept

    def take_refused(self) -> list[Refused]:
        refused, self.refused = self.refused, []
        return refused

    # -- after a restart ------------------------------------------------------------------------------------
    def restore(self, position: dict, blocks_before: int) -> None:
        """Take over a state record's position (epoch, pending references, blocks read) and read those tasks
        back from the topic (group-less). A task no longer there (retention) or no longer valid is skipped, with a
        warning. ``blocks_before``: the blocks read, for a record written before it counted them."""
        self.epoch = position.get("epoch", 0)
        self.pending = [list(ref) for ref in position.get("pending", [])]
        self.blocks = position.get("blocks", blocks_before)
        wanted = {(partition, offset) for _, partition, offset in self.pending}
        if not wanted:
            return
        found = self._read_at(wanted)
        lost = [ref for ref in self.pending if (ref[1], ref[2]) not in found]
        if lost:
            logger.warning("explorer: %d pending task(s) are no longer readable on %s (retention?) and are "
                           "skipped: %s", len(lost), self.topic, ", ".join(f"[{p}]@{o}" for _, p, o in lost[:10]))
        self.pending = [ref for ref in self.pending if ref not in lost]
        for epoch, partition, offset in self.pending:
            self._by_ref[(epoch, partition, offset)] = found[(partition, offset)]

    def _read_at(self, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], Task]:
        reader = self.clients.consumer([self.topic], Task, self.config.consumer_group("explorer-restore"),
                                       client_id=f"{self.source}-restore", subscribe=False, dead_letters=False,
                                       extra={"enable.partition.eof": True})
        found: dict[tuple[int, int], Task] = {}
        try:
            starts: dict[tuple[str, int], int] = {}
            for partition, offset in wanted:
                starts[(self.topic, partition)] = min(offset, starts.get((self.topic, partition), offset))
            reader.assign(starts)
            deadline = time.monotonic() + 60
            while len(found) < len(wanted) and not reader.at_end() and time.monotonic() < deadline:
                for item in reader.poll(max_records=500, timeout=POLL_S):
                    if (item.partition, item.offset) in wanted:
                        found[(item.partition, item.offset)] = item.record
        finally:
            reader.close()
        return found
