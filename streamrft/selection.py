"""Task selection: the order in which a block of tasks read from ``tasks`` is rolled out.

Selection works on blocks (``selector.block_steps`` steps' worth of tasks) so the topic offset stays the taskset
position: a block is read, ordered, and kept in the explorer's state record until every task of it has been
published; a restart continues the same block in the same order.
"""
from __future__ import annotations

import random
from collections import defaultdict

from streamrft.schemas import RolloutResult, Task


class Selector:
    """``sequential``: topic order. ``shuffle``: a seeded permutation per (epoch, block). ``difficulty``:
    tasks whose pass rate so far is closest to 0.5 first (unseen tasks count as 0.5), ties in topic order."""

    def __init__(self, kind: str, seed: int = 0):
        if kind not in ("sequential", "shuffle", "difficulty"):
            raise ValueError(f"unknown selector {kind!r}: use sequential, shuffle or difficulty")
        self.kind = kind
        self.seed = seed
        self._passed: dict[str, float] = defaultdict(float)
        self._seen: dict[str, int] = defaultdict(int)

    def order(self, tasks: list[Task], epoch: int, block: int) -> list[Task]:
        if self.kind == "sequential":
            return list(tasks)
        if self.kind == "shuffle":
            shuffled = list(tasks)
            random.Random(f"{self.seed}:{epoch}:{block}").shuffle(shuffled)
            return shuffled
        return sorted(tasks, key=lambda task: abs(self.pass_rate(task.task_id) - 0.5))

    def observe(self, result: RolloutResult) -> None:
        """Feed a finished task's outcome (difficulty selection learns from it)."""
        if result.n > 0:
            self._passed[result.task_id] += result.accuracy
            self._seen[result.task_id] += 1

    def pass_rate(self, task_id: str) -> float:
        seen = self._seen.get(task_id, 0)
        return self._passed[task_id] / seen if seen else 0.5
