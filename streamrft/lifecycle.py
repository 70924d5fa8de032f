"""Graceful stop for long-running commands: the first SIGINT/SIGTERM asks the loop to finish its current unit
of work and leave cleanly; a second one interrupts at once."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)


class StopSignal:
    """``with StopSignal() as stop: while not stop.requested: ...``"""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self._event = threading.Event()
        self._signals = signals
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking early when a stop is requested."""
        return self._event.wait(timeout)

    def _handle(self, signum, frame) -> None:
        if self._event.is_set():
            raise KeyboardInterrupt
        logger.info("%s received: finishing the current step, then stopping (again to interrupt)",
                    signal.Signals(signum).name)
        self._event.set()

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (a no-op elsewhere). Safe between fork
    and exec; a caller that may already be orphaned checks ``os.getppid()`` afterwards."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # not Linux: the launcher's own stop path is the only guard
        pass


def exit_with_launcher() -> None:
    """Killed (SIGKILL) when the process that started this one dies, e.g. a trainer rank when torchrun is
    killed: a rank left behind would hold its GPU and its collectives forever."""
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
