"""Reading the run's signal topics: ``sync`` (the trainer's: published weights, sync requests, the collective
group) and ``control`` (the explorer's: its state, cancelled steps).

Every role keeps one ``SyncView``; it reads both (compacted) topics from the beginning at start and then follows
them, so its picture is rebuilt from the topics alone — no local state, no RPC. Every signal is checked where
it is read (``streamrft.validation.TOPIC_CHECKS``: ``check_sync`` / ``check_control``, which also refuse a kind
on the other writer's topic); a bad one is skipped by every role and dead-lettered by one of them, the explorer
(``dead_letters=True``), so the DLQ holds it once.
"""
from __future__ import annotations

import logging
import time
from functools import partial

from streamrft.kafka import KafkaClients
from streamrft.schemas import SyncKind, SyncSignal
from streamrft.explorer_state import ExplorerState
from streamrft.validation import TOPIC_CHECKS

logger = logging.getLogger(__name__)

__all__ = ["SyncView", "supersedes"]


def supersedes(current: SyncSignal | None, incoming: SyncSignal) -> bool:
    """Whether ``incoming`` weights replace ``current``: within one trainer lineage a higher version does, and
    the same version announced again with another manifest sha256 (so a signal that was wrong about a version
    cannot hide the right one; loading verifies which is real); a signal of another lineage (a trainer that
    resumed from a checkpoint and lost the versions after it) replaces it whatever its version. Signals of one
    kind share a key, so they arrive in topic order."""
    if current is None:
        return True
    if incoming.lineage != current.lineage:
        return True
    return incoming.version > current.version or (incoming.version == current.version
                                                  and incoming.sha256 != current.sha256)


class SyncView:
    """Follows the run's ``sync`` and ``control`` topics (group-less, nothing committed)."""

    def __init__(self, clients: KafkaClients, client_id: str, *, dead_letters: bool = False):
        config = clients.config
        self.topic = config.topic("sync")
        control = config.topic("control")
        # partition EOF events tell when the history is read (end offsets would count transaction markers)
        self._consumer = clients.consumer(
            [self.topic, control], SyncSignal, group=config.consumer_group("sync-view"), client_id=client_id,
            subscribe=False, dead_letters=dead_letters, extra={"enable.partition.eof": True},
            check={self.topic: partial(TOPIC_CHECKS["sync"], weights_method=config.trainer.weights.method,
                                       weights_url=config.weights_url),
                   control: TOPIC_CHECKS["control"]})
        self._consumer.assign(clients.offsets(self.topic, "start") | clients.offsets(control, "start"))
        self.weights: SyncSignal | None = None
        self.explorer = ExplorerState()
        self._cancels: set[int] = set()  # CANCEL_STEP steps not yet known to be valid or superseded
        self._cancelled = -1
        self.collective_ready: SyncSignal | None = None  # the trainer's newest weight-sync group (NCCL_READY)
        self.requested: SyncSignal | None = None  # trainer_driven: the version the trainer asked workers to serve
        # (partition, offset) of each of the two above, for the dead letter of a refused one
        self.where: dict[SyncKind, tuple[int, int]] = {}
        self.caught_up = False

    @property
    def version(self) -> int:
        return self.weights.version if self.weights is not None else 0

    @property
    def requested_version(self) -> int:
        """trainer_driven: the newest version the current trainer asked the workers to move to (0: none yet, or
        only an older trainer lineage's request), never above the newest it published."""
        if self.requested is None or self.weights is None or self.requested.lineage != self.weights.lineage:
            return 0
        # a trainer requests only what it has published: a forged request for v10^9 must not let the explorer
        # run ahead unbounded, nor send workers waiting for weights that will never come
        return min(self.requested.version, self.weights.version)

    @property
    def lineage(self) -> str:
        return self.weights.lineage if self.weights is not None else ""

    @property
    def cancelled_step(self) -> int:
        """The newest step the explorer cancelled. A CANCEL_STEP counts only once the explorer's state shows
        the step was published (step < next_step): a forged one for step 10^9 must not cancel everything
        (it is held, not dropped, because a cancel and the state that covers it can arrive in either order
        in a compacted topic)."""
        valid = [v for v in self._cancels if v < self.explorer.next_step]
        if valid:
            self._cancelled = max(self._cancelled, *valid)
            self._cancels -= set(valid)
        return self._cancelled

    @property
    def rejected(self) -> int:
        return self._consumer.rejected

    def poll(self, timeout: float = 0.0) -> list[SyncSignal]:
        """Apply new signals; returns them. ``caught_up`` turns true once the history at start is read."""
        signals = []
        for item in self._consumer.poll(max_records=500, timeout=timeout):
            self._apply(item.record)
            if item.record is self.weights or item.record is self.collective_ready:
                self.where[item.record.kind] = (item.partition, item.offset)
            signals.append(item.record)
        if not self.caught_up and self._consumer.at_end():
            self.caught_up = True
        return signals

    def catch_up(self, timeout: float = 30.0) -> None:
        """Read the history that existed at start (so state is complete before the role acts on it)."""
        deadline = time.monotonic() + timeout
        while not self.caught_up:
            self.poll(0.2)
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.topic} and its control topic to their end in "
                                   f"{timeout:.0f}s; is the broker up?")

    def _apply(self, signal: SyncSignal) -> None:
        if signal.kind == SyncKind.WEIGHTS_PUBLISHED:
            if supersedes(self.weights, signal):
                if self.weights is not None and signal.lineage != self.weights.lineage:
                    logger.info("weights: trainer lineage %s replaces %s (v%d after v%d)", signal.lineage or "-",
                                self.weights.lineage or "-", signal.version, self.weights.version)
                self.weights = signal
        elif signal.kind == SyncKind.EXPLORER_STATE:
            self.explorer = ExplorerState.from_json(signal.state)  # checked when read: it parses
        elif signal.kind == SyncKind.NCCL_READY:
            self.collective_ready = signal
        elif signal.kind == SyncKind.SYNC_REQUEST:
            if supersedes(self.requested, signal):
                self.requested = signal
        elif signal.kind == SyncKind.CANCEL_STEP:
            if signal.explorer_step > self._cancelled:
                self._cancels.add(signal.explorer_step)

    def close(self) -> None:
        self._consumer.close()
