"""The trainer's committed offsets on its consumer group, and the guard that no one else moved them.

The trainer reads with ``assign`` (where it reads from is its checkpoint's business), so its consumer group never
has members, and Kafka's own tools accept a reset of it at any moment: ``kafka-consumer-groups --reset-offsets``
asks only that the group be inactive. What the group holds still matters: the explorer paces on its lag, and an
operator reads it as "where the trainer is". So:

- every commit of the trainer carries a mark in its metadata (``{"by": <group>, "step": N}``); a reset by Kafka's
  tools writes the offset alone, with empty metadata;
- at every start with a checkpoint, a committed offset without this trainer's mark is a reset it did not make;
- while it runs, before every commit and once a second while idle, the group's offsets are read back and compared
  with what the trainer committed last: any difference is someone else's.

A reset found stops the trainer with both positions and the two ways on (:class:`OffsetReset`), unless it runs
with ``--accept-offset-reset``: then it reads on from the group's offsets (with the checkpoint's weights and step),
and until a newer checkpoint holds the new positions, each commit's metadata carries the accepted reset
(``"accepted": [step, offset]``), so a restart in between goes on from it too rather than undoing it. The check and
the commit are two requests: a reset that lands in the milliseconds between them is overwritten; stop the trainer
before a reset to rule that out.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from streamrft.errors import OperatorNeeded
from streamrft.kafka import unanswered
from streamrft.kafka.consumer import CommitPoints, Offsets, RecordConsumer

logger = logging.getLogger(__name__)


class OffsetReset(OperatorNeeded):
    """The trainer's consumer group holds offsets the trainer did not commit (a reset by Kafka's tools)."""


@dataclass(frozen=True)
class Moved:
    """One partition the group holds elsewhere than the trainer: ``group`` is the group's committed offset,
    ``trainer`` the trainer's (its checkpoint's position at a start, its last commit while running)."""

    topic: str
    partition: int
    group: int
    trainer: int | None

    def __str__(self) -> str:
        trainer = "none" if self.trainer is None or self.trainer < 0 else str(self.trainer)
        return f"{self.topic}[{self.partition}] group at {self.group}, trainer at {trainer}"


@dataclass(frozen=True)
class Mark:
    """What the trainer's commit metadata says: who committed, after which step, and a reset it accepted (the
    step of the checkpoint it went on from, and the offset it was reset to), if one is not yet in a checkpoint."""

    by: str
    step: int
    accepted: tuple[int, int] | None = None

    def text(self) -> str:
        data = {"by": self.by, "step": self.step}
        if self.accepted is not None:
            data["accepted"] = list(self.accepted)
        return json.dumps(data, separators=(",", ":"))

    @staticmethod
    def parse(text: str) -> "Mark | None":
        """The mark in a commit's metadata, or None when it holds none (another writer's commit)."""
        try:
            data = json.loads(text) if text else None
            if not isinstance(data, dict) or not isinstance(data.get("by"), str):
                return None
            accepted = data.get("accepted")
            return Mark(data["by"], int(data.get("step", 0)),
                        (int(accepted[0]), int(accepted[1])) if accepted is not None else None)
        except (ValueError, TypeError, IndexError, KeyError):
            return None


def reset_message(group: str, moved: list[Moved], *, running: bool, replay_hint: str) -> str:
    """Why the trainer stops, with both positions and the two ways on."""
    when, ours = (("while the trainer ran", "its last commit") if running else
                  ("since the trainer's checkpoint", "its checkpoint's position"))
    where = "; ".join(str(m) for m in moved)
    return (f"consumer group {group} was moved by someone else {when} (a `kafka-consumer-groups --reset-offsets`?): "
            f"{where} (trainer: {ours}). The trainer does not overwrite it. Either replay as a new lineage, leaving "
            "this one and the "
            f"group as they were: `streamrft train CONFIG --group NAME --replay-from {replay_hint}` (its own "
            f"group and checkpoints); or accept the reset and read on from the group's offsets with this "
            f"lineage's weights: `streamrft train CONFIG --accept-offset-reset` (`streamrft run CONFIG --resume "
            f"--accept-offset-reset`)")


class GroupOffsets:
    """The trainer's commits to its group (marked), and the check that the group still holds them."""

    def __init__(self, consumer: RecordConsumer, *, accept: bool, on_accepted: Callable[[Offsets], None]):
        self.consumer = consumer
        self.group = consumer.group_id
        self.accept = accept
        self.on_accepted = on_accepted  # the trainer reads on from these offsets
        self.last: CommitPoints = {}  # what the group holds, as far as the trainer knows
        self.accepted: dict[tuple[str, int], tuple[int, int]] = {}  # tp -> (checkpoint step, offset)

    # -- a start ---------------------------------------------------------------------------------------------
    def begin(self, partitions: list[tuple[str, int]]) -> None:
        """A new lineage: it starts from whatever the group holds, which becomes what later checks compare with."""
        self.accepted.clear()
        self.last = self.consumer.committed(partitions)

    def resume(self, step: int, positions: Offsets) -> Offsets:
        """At a start from checkpoint ``step`` (its reader ``positions``): the partitions to read from elsewhere
        than the checkpoint says, because the group was reset and the reset is (or was) accepted. Raises
        :class:`OffsetReset` for a reset this trainer did not make, unless it accepts resets."""
        committed = self.consumer.committed(list(positions))
        self.accepted.clear()
        moved, elsewhere = [], {}
        for tp, (offset, metadata) in sorted(committed.items()):
            if offset < 0:
                continue
            mark = Mark.parse(metadata)
            if mark is None or mark.by != self.group:
                if offset != positions.get(tp):  # a reset to where the checkpoint is moves nothing
                    moved.append(Moved(tp[0], tp[1], offset, positions.get(tp)))
            elif mark.accepted is not None and mark.accepted[0] == step:
                self.accepted[tp] = mark.accepted  # accepted before a restart, not yet in a checkpoint
                elsewhere[tp] = mark.accepted[1]
        self.last = committed
        if moved:
            self._accept_or_stop(moved, step, running=False)
            elsewhere.update({(m.topic, m.partition): m.group for m in moved})
        return elsewhere

    # -- while running ---------------------------------------------------------------------------------------
    def check(self, checkpoint_step: int) -> Offsets:
        """Read the group's offsets back: the partitions someone else moved since the trainer's last commit,
        accepted (then the trainer reads on from them) or raised as :class:`OffsetReset`. A cluster that does not
        answer now is asked again at the next check."""
        try:
            committed = self.consumer.committed(list(self.last))
        except Exception as exc:  # noqa: BLE001 - the client layer's exception; unanswered() tells which
            if not unanswered(exc):
                raise
            logger.warning("%s: the group's offsets not read back now (%s); checked again later", self.group, exc)
            return {}
        moved = [Moved(tp[0], tp[1], offset, self.last[tp][0]) for tp, (offset, _) in sorted(committed.items())
                 if offset != self.last[tp][0] and offset >= 0]  # a reset to where it was moves nothing
        self.last.update(committed)
        if not moved:
            return {}
        self._accept_or_stop(moved, checkpoint_step, running=True)
        offsets = {(m.topic, m.partition): m.group for m in moved}
        self.on_accepted(offsets)
        return offsets

    def commit(self, offsets: Offsets, step: int, checkpoint_step: int) -> None:
        """Commit ``offsets`` marked as the trainer's, after checking that the group still holds what the trainer
        committed last; partitions reset meanwhile (and accepted) keep the group's offset."""
        moved = self.check(checkpoint_step)
        offsets = {tp: o for tp, o in offsets.items() if tp not in moved}
        marks = {tp: Mark(self.group, step, self.accepted.get(tp)).text() for tp in offsets}
        self.consumer.commit_offsets(offsets, marks)
        self.last.update({tp: (o, marks[tp]) for tp, o in offsets.items()})

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` holds the reader's positions: resets accepted before it need no carrying."""
        self.accepted = {tp: a for tp, a in self.accepted.items() if a[0] >= step}

    @property
    def carries_accepted(self) -> bool:
        return bool(self.accepted)

    def _accept_or_stop(self, moved: list[Moved], step: int, *, running: bool) -> None:
        if not self.accept:
            starts = {m.group for m in moved}
            hint = str(starts.pop()) if len(starts) == 1 else "earliest|OFFSET|TIME"
            raise OffsetReset(reset_message(self.group, moved, running=running, replay_hint=hint))
        for m in moved:
            self.accepted[(m.topic, m.partition)] = (step, m.group)
        logger.warning("%s: reset accepted (--accept-offset-reset), reading on from the group's offsets with the "
                       "weights of step %d: %s", self.group, step, "; ".join(str(m) for m in moved))
