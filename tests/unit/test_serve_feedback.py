"""Serve mode's bookkeeping without a broker or a model: pending completions expire, are bounded and are taken
once; the three groupings give the group ids, sizes and run indices the trainer needs."""
from __future__ import annotations

import pytest

from streamrft.consumers.serve.feedback import FeedbackError, Grouping, PendingExperiences
from streamrft.engines.inference import Completion


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def completions(n: int) -> list[Completion]:
    return [Completion(prompt_ids=[1, 2], response_ids=[3 + i], logprobs=[-0.5], text=str(i), finish_reason="stop",
                       model_version=2) for i in range(n)]


def test_pending_completions_expire_are_bounded_and_are_taken_once():
    clock = Clock()
    pending = PendingExperiences(ttl_s=10, capacity=3, clock=clock)
    pending.add("a", completions(2))
    clock.now += 6
    pending.add("b", completions(1))
    assert pending.take("a", 1).completion.text == "1"
    with pytest.raises(FeedbackError) as twice:
        pending.take("a", 1)
    assert twice.value.status == 409
    clock.now += 5  # a is 11 s old: expired; b is 5 s old
    with pytest.raises(FeedbackError) as gone:
        pending.take("a", 0)
    assert gone.value.status == 404 and pending.expired == 1
    pending.add("c", completions(3))  # 4 waiting > capacity 3: the oldest (b) goes
    assert pending.evicted == 1 and len(pending) == 3
    with pytest.raises(FeedbackError):
        pending.take("b", 0)
    taken = pending.take("c", 2)
    pending.give_back(taken)  # its experience could not be written: it may be sent again
    assert pending.take("c", 2) is taken


def test_groupings_name_the_group_its_size_and_the_run_index():
    pending = PendingExperiences(ttl_s=10, capacity=10)
    pending.add("req", completions(3))
    third = pending.take("req", 2)
    assert Grouping("request", 4, "s").assign(third, None, None) == ("req", 3, 2)
    counted = Grouping("count", 2, "s")
    assert [counted.assign(third, None, None) for _ in range(3)] == [("s-g0", 2, 0), ("s-g0", 2, 1), ("s-g1", 2, 0)]
    client = Grouping("client", 4, "s")
    assert client.assign(third, "conv-1", 2) == ("conv-1", 2, 0)
    assert client.assign(third, "conv-1", 2) == ("conv-1", 2, 1)
    with pytest.raises(FeedbackError) as full:
        client.assign(third, "conv-1", 2)
    assert full.value.status == 409
    with pytest.raises(FeedbackError) as unnamed:
        client.assign(third, None, None)
    assert unnamed.value.status == 400


def test_conversations_hold_rewarded_responses_until_they_end_and_expire_when_they_never_do():
    from streamrft.consumers.serve.feedback import Conversations, Pending

    clock = Clock()
    conversations = Conversations(ttl_s=10, clock=clock)
    turns = [Pending(c, f"r{i}", 0, 1, clock.now, conversation="c1") for i, c in enumerate(completions(3))]
    assert [conversations.add(p, float(i)) for i, p in enumerate(turns[:2])] == [1, 2]
    other = Pending(completions(1)[0], "x", 0, 1, clock.now, conversation="c2")
    conversations.add(other, 1.0)
    assert len(conversations) == 3
    clock.now += 8
    conversations.add(turns[2], 2.0)  # feedback keeps c1 open
    held = conversations.end("c1")
    assert [(p.request_id, r) for p, r in held] == [("r0", 0.0), ("r1", 1.0), ("r2", 2.0)]
    assert conversations.end("c1") == []  # ended once
    clock.now += 3  # c2: 11 s without feedback
    conversations.add(Pending(completions(1)[0], "y", 0, 1, clock.now, conversation="c3"), 0.0)
    assert conversations.expired == 1 and conversations.end("c2") == []
