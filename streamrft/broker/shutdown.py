"""Waiting for a stopping broker's nodes: one rule for `EmbeddedBroker.stop` and `streamrft broker stop`.

A KRaft broker's controlled shutdown waits for the controller quorum's approval (up to 5 minutes). Every node
gets its SIGTERM at once, so the last nodes of a cluster may find the quorum already gone: they cannot finish,
and waiting the whole timeout for them only delays the SIGKILL they will get anyway. Their data is safe: the next
start recovers the logs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

QUORUMLESS_GRACE_S = 3.0  # what a node left without a controller quorum gets to finish


def await_exit(alive: Sequence[Callable[[], bool]], timeout: float, poll_s: float = 0.1) -> None:
    """Until every node has exited (each ``alive[i]()`` is False), ``timeout`` s passed, or the nodes still
    running have had QUORUMLESS_GRACE_S without a quorum (a majority of ``len(alive)``)."""
    deadline = time.monotonic() + timeout
    quorum = len(alive) // 2 + 1
    quorum_gone_at = None
    while time.monotonic() < deadline:
        running = sum(1 for is_alive in alive if is_alive())
        if running == 0:
            return
        if len(alive) > 1 and running < quorum:
            quorum_gone_at = quorum_gone_at or time.monotonic()
            if time.monotonic() - quorum_gone_at > QUORUMLESS_GRACE_S:
                return
        time.sleep(poll_s)


def left_without_quorum(total: int, running: int) -> bool:
    """Whether ``running`` nodes still up of ``total`` are the expected quorumless stragglers (see above)."""
    return total > 1 and 0 < running <= total // 2
