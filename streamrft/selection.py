"""Task order: the order in which a taskset's tasks (a block read from a topic, or a file's epoch) are rolled out.

A topic-fed taskset orders blocks (``selector.block_steps`` steps' worth of tasks) so the topic offset stays its
position: a block is read, ordered, and kept in the explorer's state record until every task of it has been
published; a restart continues the same block in the same order. A file-fed taskset orders the whole file each time
it takes tasks and hands out the first ones not yet taken this epoch.
"""
from __future__ import annotations

import json
import random
from collections import defaultdict

from streamrft.schemas import RolloutResult, Task

KINDS = ("sequential", "shuffle", "field", "difficulty", "learnable")


class Selector:
    """``sequential``: the source's order. ``shuffle``: a seeded permutation per (epoch, block). ``field``: by the
    payload's ``field`` (``descending`` or not), tasks without it last: a curriculum. ``difficulty``: the tasks the
    policy fails first, priority 1 − pass rate (unseen tasks 0.5). ``learnable``: pass rate closest to 0.5 first,
    solved and hopeless tasks last. Ties keep the source's order. Pass rates come from :meth:`observe`."""

    def __init__(self, kind: str, seed: int = 0, field: str | None = None, descending: bool = False):
        if kind not in KINDS:
            raise ValueError(f"unknown task order {kind!r}: use {', '.join(KINDS)}")
        if kind == "field" and not field:
            raise ValueError("task order field needs the payload field to order by")
        self.kind = kind
        self.seed = seed
        self.field = field
        self.descending = descending
        self._passed: dict[str, float] = defaultdict(float)
        self._seen: dict[str, int] = defaultdict(int)
        self._latest: dict[str, float] = {}  # accuracy of each task's latest rollout

    @property
    def learns(self) -> bool:
        """Whether the order depends on the results seen (a restart rebuilds them from ``results``)."""
        return self.kind in ("difficulty", "learnable")

    def order(self, tasks: list[Task], epoch: int, block: int) -> list[Task]:
        if self.kind == "sequential":
            return list(tasks)
        if self.kind == "shuffle":
            shuffled = list(tasks)
            random.Random(f"{self.seed}:{epoch}:{block}").shuffle(shuffled)
            return shuffled
        if self.kind == "field":
            present = [t for t in tasks if self._field(t) is not None]
            missing = [t for t in tasks if self._field(t) is None]
            key = lambda task: (isinstance(self._field(task), str), self._field(task))  # noqa: E731 - numbers, then text
            return sorted(present, key=key, reverse=self.descending) + missing
        if self.kind == "difficulty":
            return sorted(tasks, key=lambda task: self.pass_rate(task.task_id))
        return sorted(tasks, key=lambda task: abs(self.pass_rate(task.task_id) - 0.5))

    def observe(self, result: RolloutResult) -> None:
        """Feed a finished task's outcome (difficulty and learnable orders learn from it)."""
        if result.n > 0:
            self._passed[result.task_id] += result.accuracy
            self._seen[result.task_id] += 1
            self._latest[result.task_id] = result.accuracy

    def pass_rate(self, task_id: str) -> float:
        seen = self._seen.get(task_id, 0)
        return self._passed[task_id] / seen if seen else 0.5

    def solved(self, task_id: str) -> bool:
        """Its latest rollout was right in every sample."""
        return self._latest.get(task_id, 0.0) >= 1.0

    def _field(self, task: Task):
        try:
            value = json.loads(task.payload or "{}").get(self.field)
        except (json.JSONDecodeError, AttributeError):
            return None
        return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
