"""The trainer's buffer of experiences by GRPO group (no Kafka, no torch): which groups are complete,
which expired, and the oldest offset still untrained per partition."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable


from streamrft.kafka.consumer import Delivered, Offsets
from streamrft.schemas import Experience, Objective



@dataclass
class Group:
    """The experiences of one ``group_id`` read so far, by eid (a redelivered duplicate is kept once)."""

    group_id: str
    step: int
    size: int
    first_seen: float
    items: dict[str, Delivered[Experience]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.items) >= self.size

    @property
    def experiences(self) -> list[Experience]:
        return [item.record for item in self.items.values()]

    @property
    def objective(self) -> Objective:
        """What the group trains (its records share one: one task's samples, a conversation or a pair)."""
        return next(iter(self.items.values())).record.objective


class GroupBuffer:
    """Experiences read but not yet trained, by GRPO group, with where each came from."""

    def __init__(self, default_group_size: int):
        self.default_group_size = default_group_size
        self.groups: dict[str, Group] = {}

    def __len__(self) -> int:
        return sum(len(g.items) for g in self.groups.values())

    def add(self, item: Delivered[Experience], now: float | None = None) -> bool:
        """False when the eid is already buffered (a duplicate)."""
        exp = item.record
        group = self.groups.get(exp.group_id)
        if group is None:
            group = self.groups[exp.group_id] = Group(exp.group_id, exp.step,
                                                      exp.group_size or self.default_group_size,
                                                      time.monotonic() if now is None else now)
        if exp.eid in group.items:
            return False
        group.items[exp.eid] = item
        return True

    def complete_groups(self) -> list[Group]:
        """Complete groups, oldest step first, then in arrival order."""
        return sorted((g for g in self.groups.values() if g.complete), key=lambda g: (g.step, g.first_seen))

    def incomplete_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if not g.complete]

    def max_step(self) -> int:
        return max((g.step for g in self.groups.values()), default=-1)

    def remove(self, groups: Iterable[Group]) -> None:
        for group in groups:
            self.groups.pop(group.group_id, None)

    def clear(self) -> None:
        self.groups.clear()

    def expired(self, now: float, timeout_s: float) -> list[Group]:
        return [g for g in self.incomplete_groups() if now - g.first_seen >= timeout_s]

    def low_water(self) -> Offsets:
        """Per partition, the lowest offset still held (nothing before it is waiting to be trained)."""
        out: Offsets = {}
        for group in self.groups.values():
            for item in group.items.values():
                tp = (item.topic, item.partition)
                out[tp] = min(out.get(tp, item.offset), item.offset)
        return out

    def items(self) -> list[Delivered[Experience]]:
        return sorted((i for g in self.groups.values() for i in g.items.values()),
                      key=lambda i: (i.topic, i.partition, i.offset))

    def drop_partitions(self, partitions: set[tuple[str, int]]) -> int:
        """Forget the groups read from ``partitions`` (a group is one key, so one partition); returns how many
        experiences went."""
        gone = [g for g in self.groups.values()
                if any((i.topic, i.partition) in partitions for i in g.items.values())]
        self.remove(gone)
        return sum(len(g.items) for g in gone)
