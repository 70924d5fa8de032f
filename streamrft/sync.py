"""Reading the ``sync`` topic: the latest published weights, the explorer's state, cancelled steps.

Every role keeps one ``SyncView``; it reads the whole (compacted) topic from the beginning at start and then
follows it, so its picture is rebuilt from the topic alone — no local state, no RPC.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from .kafka import KafkaClients
from streamrft.schemas import SyncKind, SyncSignal

logger = logging.getLogger(__name__)


@dataclass
class ExplorerState:
    """What the explorer records about itself (JSON in ``SyncSignal.state``, kind EXPLORER_STATE)."""

    next_step: int = 0
    epoch: int = 0
    # tasks read from `tasks` but not yet rolled out, in order: {"epoch": e, "task": Task dict}
    pending: list[dict] = field(default_factory=list)
    awaiting: dict | None = None  # {"step", "requests": [ids], "results_offsets": {partition: offset}}
    finished_step: int = -1  # last step whose results are all in (or cancelled / timed out)
    done: bool = False

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ExplorerState":
        return cls(**json.loads(text)) if text else cls()


class SyncView:
    """Follows the run's ``sync`` topic (group-less, nothing committed)."""

    def __init__(self, clients: KafkaClients, client_id: str):
        self.topic = clients.config.topic("sync")
        # partition EOF events tell when the history is read (end offsets would count transaction markers)
        self._consumer = clients.consumer([self.topic], SyncSignal, group=f"{clients.config.name}.sync-view",
                                          client_id=client_id, subscribe=False,
                                          extra={"enable.partition.eof": True})
        self._consumer.assign(clients.offsets(self.topic, "start"))
        self.weights: SyncSignal | None = None
        self.explorer = ExplorerState()
        self.cancelled_step = -1
        self.collective_ready: SyncSignal | None = None  # the trainer's newest weight-sync group (NCCL_READY)
        self.caught_up = False

    @property
    def version(self) -> int:
        return self.weights.version if self.weights is not None else 0

    def poll(self, timeout: float = 0.0) -> list[SyncSignal]:
        """Apply new signals; returns them. ``caught_up`` turns true once the history at start is read."""
        signals = []
        for item in self._consumer.poll(max_records=500, timeout=timeout):
            self._apply(item.record)
            signals.append(item.record)
        if not self.caught_up and self._consumer.at_end():
            self.caught_up = True
        return signals

    def catch_up(self, timeout: float = 30.0) -> None:
        """Read the history that existed at start (so state is complete before the role acts on it)."""
        import time

        deadline = time.monotonic() + timeout
        while not self.caught_up:
            self.poll(0.2)
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.topic} to its end in {timeout:.0f}s; is the broker up?")

    def _apply(self, signal: SyncSignal) -> None:
        if signal.kind == SyncKind.WEIGHTS_PUBLISHED:
            if self.weights is None or signal.version >= self.weights.version:
                self.weights = signal
        elif signal.kind == SyncKind.EXPLORER_STATE:
            self.explorer = ExplorerState.from_json(signal.state)
        elif signal.kind == SyncKind.NCCL_READY:
            self.collective_ready = signal
        elif signal.kind == SyncKind.CANCEL_STEP:
            self.cancelled_step = max(self.cancelled_step, signal.version)

    def close(self) -> None:
        self._consumer.close()
