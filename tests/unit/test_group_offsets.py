"""The trainer's guard of its consumer group (consumers/trainer/group_offsets.py) on a stand-in for the group's
committed offsets: its own commits pass, a reset by someone else stops it or is accepted, and an accepted reset
survives a restart until a checkpoint holds it. No broker (the real tool: tests/integration/test_offset_reset.py)."""
from __future__ import annotations

import pytest

from streamrft.consumers.trainer.group_offsets import GroupOffsets, Mark, OffsetReset

T = "rft.x.experiences"
A, B = (T, 0), (T, 1)


class Group:
    """What a consumer group holds, committed through a RecordConsumer's two calls."""

    group_id = "x.trainer"

    def __init__(self):
        self.held: dict = {}

    def committed(self, partitions):
        return {tp: self.held.get(tp, (-1, "")) for tp in partitions}

    def commit_offsets(self, offsets, metadata=None):
        for tp, offset in offsets.items():
            self.held[tp] = (offset, (metadata or {}).get(tp, ""))

    def reset(self, **offsets):  # what kafka-consumer-groups --reset-offsets writes: the offset, no metadata
        for tp, offset in offsets.items():
            self.held[{"a": A, "b": B}[tp]] = (offset, "")


def guard(group: Group, accept: bool = False):
    moved_to = []
    return GroupOffsets(group, accept=accept, on_accepted=moved_to.append), moved_to


def test_marks_round_trip_and_foreign_metadata_is_no_mark():
    mark = Mark("x.trainer", 7, (5, 120))
    assert Mark.parse(mark.text()) == mark
    assert Mark.parse("") is None and Mark.parse("{") is None and Mark.parse('{"by": 3}') is None
    assert Mark.parse('["x"]') is None and Mark.parse('{"by": "x", "accepted": [1]}') is None


def test_its_own_commits_pass_and_a_live_reset_stops_it_naming_both_offsets():
    group = Group()
    offsets, _ = guard(group)
    offsets.begin([A, B])
    offsets.commit({A: 10, B: 4}, step=1, checkpoint_step=0)
    offsets.commit({A: 20, B: 8}, step=2, checkpoint_step=0)
    assert Mark.parse(group.held[A][1]) == Mark("x.trainer", 2)
    group.reset(a=0, b=8)  # b: a reset to where it was moves nothing
    with pytest.raises(OffsetReset) as stopped:
        offsets.commit({A: 30, B: 12}, step=3, checkpoint_step=0)
    message = str(stopped.value)
    assert f"{T}[0] group at 0, trainer at 20" in message and f"{T}[1]" not in message
    assert "while the trainer ran" in message and "--replay-from 0" in message and "--accept-offset-reset" in message
    assert group.held[A] == (0, "")  # not overwritten


def test_a_reset_while_stopped_stops_the_resume_unless_accepted_and_the_acceptance_survives_a_restart():
    group = Group()
    first, _ = guard(group)
    first.begin([A, B])
    first.commit({A: 20, B: 8}, step=2, checkpoint_step=2)
    group.reset(a=0)
    with pytest.raises(OffsetReset, match=r"since the trainer's checkpoint.*group at 0, trainer at 16"):
        guard(group)[0].resume(2, {A: 16, B: 8})

    accepting, _ = guard(group, accept=True)
    assert accepting.resume(2, {A: 16, B: 8}) == {A: 0}
    accepting.commit({A: 3, B: 8}, step=3, checkpoint_step=2)  # trained on from the reset
    assert Mark.parse(group.held[A][1]).accepted == (2, 0)

    restarted, _ = guard(group)  # no flag now: the reset was accepted, its mark says from where
    assert restarted.resume(2, {A: 16, B: 8}) == {A: 0}
    restarted.checkpointed(4)  # a checkpoint holds the new positions: nothing to carry any more
    restarted.commit({A: 9, B: 8}, step=4, checkpoint_step=4)
    assert Mark.parse(group.held[A][1]).accepted is None
    assert guard(group)[0].resume(4, {A: 9, B: 8}) == {}


def test_an_accepted_live_reset_moves_the_reader_and_keeps_the_groups_offset():
    group = Group()
    offsets, moved_to = guard(group, accept=True)
    offsets.begin([A, B])
    offsets.commit({A: 20, B: 8}, step=2, checkpoint_step=2)
    group.reset(a=0)
    offsets.commit({A: 24, B: 8}, step=3, checkpoint_step=2)
    assert moved_to == [{A: 0}] and group.held[A][0] == 0  # the reset stands; the reader reads on from it
    assert Mark.parse(group.held[B][1]).step == 3
