"""The stop rule shared by EmbeddedBroker.stop and `streamrft broker stop`: nodes left without a controller
quorum get a short grace, not the whole timeout."""

import time

from streamrft.broker.shutdown import QUORUMLESS_GRACE_S, await_exit, left_without_quorum


def test_stragglers_without_a_quorum_are_expected_and_with_one_are_not() -> None:
    assert left_without_quorum(3, 1)
    assert not left_without_quorum(3, 2)  # two of three still have a quorum: they should have finished
    assert not left_without_quorum(1, 1)  # a single broker is its own quorum
    assert not left_without_quorum(3, 0)


def test_await_exit_returns_once_every_node_exits() -> None:
    exits_at = time.monotonic() + 0.3
    started = time.monotonic()
    await_exit([lambda: time.monotonic() < exits_at] * 3, timeout=10.0, poll_s=0.01)
    assert 0.25 < time.monotonic() - started < 2.0


def test_a_quorumless_straggler_gets_the_grace_not_the_timeout() -> None:
    started = time.monotonic()
    await_exit([lambda: False, lambda: False, lambda: True], timeout=60.0, poll_s=0.01)
    assert QUORUMLESS_GRACE_S <= time.monotonic() - started < QUORUMLESS_GRACE_S + 2.0


def test_a_node_with_a_quorum_gets_the_whole_timeout() -> None:
    started = time.monotonic()
    await_exit([lambda: False, lambda: True, lambda: True], timeout=1.0, poll_s=0.01)
    assert 1.0 <= time.monotonic() - started < 3.0
