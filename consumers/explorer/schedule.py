"""Which tasks each step rolls out: the training tasksets (``explorer.tasksets``, or the one ``tasks`` topic) and
the draw that mixes them.

Each step's ``batch_size`` tasks are drawn across the tasksets that have tasks now, by weight: one seeded draw
per step (``random.Random(f"{seed}:{step}")``), so a restarted explorer draws what the first one would have, and
each taskset hands out its next tasks in its own order. A taskset that runs out mid-step leaves its share to the
others (drawn again, seeded likewise); the run's tasks are exhausted once every taskset is.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Protocol

from streamrft.config import DEFAULT_TASKSET, RunConfig, TasksetConfig, TasksetOrder
from streamrft.kafka import KafkaClients, RecordConsumer
from streamrft.lifecycle import StopSignal
from streamrft.schemas import RolloutResult, Task
from streamrft.selection import Selector

from .task_file import FileTaskset, load_taskset_file
from .tasks import TopicTaskset


class Taskset(Protocol):
    name: str
    exhausted: bool
    selector: Selector
    skipped: int

    def ready(self, wait: bool) -> bool:
        """It has a task to hand out now (``wait``: a streaming topic may be waited on)."""

    def take(self, count: int) -> list[tuple[int, Task]]:
        """Up to ``count`` (epoch, task) pairs, in its order."""

    def observe(self, result: RolloutResult) -> None:
        """A finished task's outcome (orders that learn from it)."""

    def position(self) -> dict:
        """Where it is, for the explorer's state record."""

    def restore(self, position: dict, blocks_before: int) -> None:
        """Go on from a state record's position."""

    def take_refused(self) -> list:
        """Records read that are not to be rolled out (a task id taken, another taskset's), for the DLQ."""


def configured_tasksets(config: RunConfig) -> tuple[TasksetConfig, ...]:
    """``explorer.tasksets``, or the one taskset of a run without them: the ``tasks`` topic in the selector's
    order."""
    explorer = config.explorer
    if explorer.tasksets:
        return explorer.tasksets
    selector = explorer.selector
    # the selector's "difficulty" (closest to a 0.5 pass rate first) is the taskset order "learnable"
    kind = {"sequential": "sequential", "shuffle": "shuffle", "difficulty": "learnable"}[selector.kind]
    return (TasksetConfig(name=DEFAULT_TASKSET, topic=DEFAULT_TASKSET,
                          order=TasksetOrder(kind=kind, seed=selector.seed)),)


class TaskSchedule:
    def __init__(self, tasksets: list[Taskset], weights: dict[str, float], batch_size: int, seed: int) -> None:
        self.tasksets = tasksets
        self.weights = weights
        self.batch_size = batch_size
        self.seed = seed

    @classmethod
    def build(cls, config: RunConfig, clients: KafkaClients, consumer: RecordConsumer[Task], stop: StopSignal,
              source: str) -> "TaskSchedule":
        explorer = config.explorer
        tasksets: list[Taskset] = []
        for taskset in configured_tasksets(config):
            order = taskset.order
            selector = Selector(order.kind, order.seed, order.field, order.descending)
            if taskset.path is not None:
                tasksets.append(FileTaskset(taskset, load_taskset_file(taskset), selector,
                                            taskset.epochs or explorer.total_epochs))
            else:
                tasksets.append(TopicTaskset(config, clients, consumer, taskset, selector,
                                             explorer.selector.block_steps, stop, source))
        return cls(tasksets, {t.name: t.weight for t in configured_tasksets(config)}, explorer.batch_size,
                   explorer.selector.seed)

    @property
    def exhausted(self) -> bool:
        return all(t.exhausted for t in self.tasksets)

    def ready(self, wait: bool) -> bool:
        """A step can be composed now (some taskset has tasks; ``wait``: a streaming topic may be waited on)."""
        return any(not t.exhausted and t.ready(wait) for t in self.tasksets)

    def take(self, step: int, count: int | None = None, draw: int = 0) -> list[tuple[int, Task]]:
        """Step ``step``'s (epoch, task) pairs, drawn across the tasksets by weight (module docstring):
        ``batch_size`` of them, or ``count`` for the step's extra round ``draw`` (dynamic sampling), whose draw is
        seeded apart from the step's first."""
        taken: list[tuple[int, Task]] = []
        for attempt in range(len(self.tasksets) + 1):
            live = [t for t in self.tasksets if not t.exhausted and t.ready(wait=False)]
            wanted = (self.batch_size if count is None else count) - len(taken)
            if not live or not wanted:
                break
            seed = f"{self.seed}:{step}" + (f"+{draw}" if draw else "")
            rng = random.Random(seed + (f":{attempt}" if attempt else ""))
            counts = Counter(t.name for t in rng.choices(live, weights=[self.weights[t.name] for t in live],
                                                          k=wanted))
            for taskset in live:
                if counts[taskset.name]:
                    taken += taskset.take(counts[taskset.name])
        return taken

    def take_refused(self) -> list:
        """The task records read that are not to be rolled out (a topic taskset's refusals), for the DLQ."""
        return [refused for taskset in self.tasksets for refused in taskset.take_refused()]

    def observe(self, result: RolloutResult) -> None:
        for taskset in self.tasksets:
            taskset.observe(result)

    def positions(self) -> dict[str, dict]:
        return {t.name: t.position() for t in self.tasksets}

    def restore(self, positions: dict[str, dict], blocks_before: int) -> None:
        """Each taskset from its entry of a state record (a taskset the record does not know starts afresh)."""
        for taskset in self.tasksets:
            taskset.restore(positions.get(taskset.name, {}), blocks_before)

    @property
    def learns(self) -> bool:
        """Some taskset's order depends on the results seen (a restart rebuilds them from ``results``)."""
        return any(t.selector.learns for t in self.tasksets)

    @property
    def topics(self) -> list[str]:
        """The topics the explorer's tasks consumer reads: the topic-fed tasksets'."""
        return [t.topic for t in self.tasksets if isinstance(t, TopicTaskset)]

