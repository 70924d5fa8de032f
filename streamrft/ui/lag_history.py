"""Consumer-group lag over time: a thread samples each group's lag per topic every few seconds into a bounded
in-memory history, which the groups page draws. Nothing is stored: the history starts with the UI."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from ..kafka.inspection import GroupState

logger = logging.getLogger(__name__)

# (group, topic) -> [(unix time s, lag)], oldest first
Samples = dict[tuple[str, str], deque]


class LagHistory:
    def __init__(self, keep: int):
        self.keep = keep
        self._samples: Samples = {}
        self._lock = threading.Lock()

    def add(self, groups: list[GroupState], at: float) -> None:
        with self._lock:
            for group in groups:
                for topic, lag in group.lag_by_topic().items():
                    line = self._samples.setdefault((group.group, topic), deque(maxlen=self.keep))
                    line.append((at, float(lag)))

    def of(self, group: str) -> dict[str, list[tuple[float, float]]]:
        """topic -> its samples for ``group``."""
        with self._lock:
            return {topic: list(line) for (g, topic), line in self._samples.items() if g == group}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(line) for line in self._samples.values())


class LagSampler(threading.Thread):
    """Calls ``groups`` every ``every_s`` seconds until stopped; a cluster that does not answer for a while (a
    broker restart) leaves a gap in the history, never stops the thread."""

    def __init__(self, groups: Callable[[], list[GroupState]], history: LagHistory, every_s: float):
        super().__init__(name="lag-sampler", daemon=True)
        self.groups = groups
        self.history = history
        self.every_s = every_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.sample()
            self.stopped.wait(self.every_s)

    def sample(self) -> None:
        try:
            self.history.add(self.groups(), time.time())
        except Exception as exc:  # any client error: this sample is missing, the next one tries again
            logger.warning("lag not sampled: %s", exc)

    def stop(self) -> None:
        self.stopped.set()
