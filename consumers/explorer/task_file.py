"""A taskset read from a file by the explorer itself (``explorer.tasksets[].path``): no topic, so its position is
in the explorer's state record, written with every transaction: the epoch and which of the file's tasks this epoch
has rolled out (a bitmap), so a restarted explorer goes on exactly where the record says.

Order within an epoch (``order``): the file's, a seeded shuffle per epoch, a payload field (a curriculum), or
``difficulty``: the tasks the policy fails most first (priority 1 − pass rate, from the results of earlier rollouts;
unseen tasks 0.5), and with ``skip_solved`` a task whose latest rollout was right in every sample is passed over
(counted as skipped), as DAPO and POLARIS drop solved prompts.
"""
from __future__ import annotations

import base64
import logging

from streamrft.config import TasksetConfig
from streamrft.producers.task_files import FieldMapping, Rejected, read_tasks
from streamrft.schemas import RolloutResult, Task
from streamrft.selection import Selector

logger = logging.getLogger(__name__)


def load_taskset_file(taskset: TasksetConfig) -> list[Task]:
    """The file's tasks, named ``<taskset>-<line>``; rows that cannot be tasks are reported and left out."""
    mapping = FieldMapping(prompt_key=taskset.prompt_key, answer_key=taskset.answer_key,
                           workflow=taskset.workflow or "arithmetic", taskset=taskset.name,
                           reward_fn=taskset.reward_fn, repeat_times=taskset.repeat_times)
    rows = list(read_tasks(taskset.path, mapping))
    rejected = [row for row in rows if isinstance(row, Rejected)]
    if rejected:
        logger.warning("explorer: taskset %s: %d row(s) of %s are not tasks and are left out (first: line %d, %s); "
                       "`streamrft tasks produce %s --rejects FILE` lists them all", taskset.name, len(rejected),
                       taskset.path, rejected[0].line, rejected[0].reason, taskset.path)
    tasks = [row for row in rows if isinstance(row, Task)]
    if not tasks:
        raise ValueError(f"taskset {taskset.name}: {taskset.path} holds no task (check prompt_key "
                         f"{taskset.prompt_key!r} and answer_key {taskset.answer_key!r})")
    return tasks


class FileTaskset:
    def __init__(self, taskset: TasksetConfig, tasks: list[Task], selector: Selector, epochs: int | None) -> None:
        self.taskset = taskset
        self.name = taskset.name
        self.tasks = tasks
        self.selector = selector
        self.epochs = epochs  # None: the file again and again
        self.epoch = 0
        self._taken = bytearray((len(tasks) + 7) // 8)
        self._index = {id(task): i for i, task in enumerate(tasks)}
        self.skipped = 0  # solved tasks passed over (order difficulty, skip_solved)
        self.exhausted = False

    # -- the schedule's calls -------------------------------------------------------------------------------
    def ready(self, wait: bool) -> bool:
        return not self.exhausted

    def take_refused(self) -> list:
        return []  # a file's tasks are named by their line: no two share an id

    def take(self, count: int) -> list[tuple[int, Task]]:
        """Up to ``count`` (epoch, task) pairs, the next in the taskset's order; fewer only when it runs out."""
        out: list[tuple[int, Task]] = []
        skipped_in_a_row = 0
        while len(out) < count and not self.exhausted:
            untaken = [i for i in self._in_order() if not self._is_taken(i)]
            if not untaken:
                self._next_epoch()
                continue
            for i in untaken:
                if len(out) == count:
                    break
                self._mark(i)
                if self.taskset.order.skip_solved and self.selector.solved(self.tasks[i].task_id):
                    self.skipped += 1
                    skipped_in_a_row += 1
                    if skipped_in_a_row >= len(self.tasks):  # a whole file's worth: nothing is left to learn
                        logger.info("explorer: taskset %s: every task is solved; it is done", self.name)
                        self.exhausted = True
                        break
                    continue
                skipped_in_a_row = 0
                out.append((self.epoch, self.tasks[i]))
        return out

    def observe(self, result: RolloutResult) -> None:
        self.selector.observe(result)

    def position(self) -> dict:
        return {"epoch": self.epoch, "taken": base64.b64encode(bytes(self._taken)).decode()}

    def restore(self, position: dict, blocks_before: int = 0) -> None:
        self.epoch = position.get("epoch", 0)
        taken = base64.b64decode(position["taken"]) if position.get("taken") else b""
        if taken and len(taken) != len(self._taken):
            logger.warning("explorer: taskset %s: %s has %d tasks now, the state record knew another count; its "
                           "epoch %d starts over", self.name, self.taskset.path, len(self.tasks), self.epoch)
            taken = b""
        self._taken = bytearray(taken) if taken else bytearray(len(self._taken))

    # -- order and the taken bitmap -----------------------------------------------------------------------
    def _in_order(self) -> list[int]:
        """The file's task indices in the taskset's order for this epoch (one block per epoch)."""
        return [self._index[id(task)] for task in self.selector.order(self.tasks, self.epoch, 0)]

    def _is_taken(self, i: int) -> bool:
        return bool(self._taken[i // 8] & (1 << (i % 8)))

    def _mark(self, i: int) -> None:
        self._taken[i // 8] |= 1 << (i % 8)

    def _next_epoch(self) -> None:
        if self.epochs is not None and self.epoch + 1 >= self.epochs:
            self.exhausted = True
            return
        self.epoch += 1
        self._taken = bytearray(len(self._taken))
        logger.info("explorer: taskset %s: epoch %d starts", self.name, self.epoch)
