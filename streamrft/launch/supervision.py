"""The restart policy of ``streamrft run`` (``launch.restart``), pure: given a role's exits and the times they
happened, restart it after a back-off or give up. No processes and no clock here; the launcher
(``supervisor.py``) passes ``now`` in, so a test drives it with made-up times.

A role that exits with ``OPERATOR_EXIT`` (78) stopped for a person's decision (its message says which, e.g. a
consumer group reset by someone else): it is not restarted, and the run stops with its log tail at once.

Back-off: ``backoff_s · 2^(k−1)``, capped at ``backoff_max_s``, where k counts the role's crashes within the last
``window_s`` (this one included): a role that crashed once long ago waits ``backoff_s`` again. Crash loop: a crash
that would be restart number ``max_restarts + 1`` within ``window_s`` stops the run.
"""
from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass

from streamrft.config.supervision import RestartConfig
from streamrft.errors import OPERATOR_EXIT


@dataclass(frozen=True)
class Restart:
    """Start the role again at ``at`` (``delay`` seconds after its exit); ``count``: its restarts so far, this
    one included."""

    at: float
    delay: float
    count: int


@dataclass(frozen=True)
class GiveUp:
    """A crash loop: the run stops."""

    role: str
    exit_code: int
    crashes: int
    window_s: float
    max_restarts: int

    def message(self, log_path: object, log_tail: str) -> str:
        if self.exit_code == OPERATOR_EXIT:
            return (f"{self.role} stopped for an operator's decision (exit code {OPERATOR_EXIT}) and is not "
                    f"restarted; the run stops. Its log ({log_path}) ends with what to do:\n{log_tail}\nThen "
                    "continue with the same command plus --resume (and the flag the log names, if any)")
        return (f"{self.role} crashed {self.crashes} times within {self.window_s:g}s (launch.restart.max_restarts "
                f"is {self.max_restarts}), last {describe_exit(self.exit_code)}; the run stops. Its log "
                f"({log_path}) ends with:\n{log_tail}\nFix what the log says, then continue with the same command "
                "plus --resume (or raise launch.restart.max_restarts / window_s)")


def describe_exit(code: int) -> str:
    """``exit code 1``, or ``killed by SIGKILL (-9)`` for a signal (Popen's negative return code)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name} ({code})"
    except ValueError:
        return f"killed by signal {-code} ({code})"


def is_clean(code: int) -> bool:
    """0: the role ended its work or was asked to stop; anything else (an error, a signal) is a crash."""
    return code == 0


class RestartPolicy:
    """One role's restart history under ``launch.restart``."""

    def __init__(self, role: str, settings: RestartConfig):
        self.role = role
        self.settings = settings
        self.restarts = 0  # over the whole run, for the dashboard
        self._crashes: deque[float] = deque()  # times of the crashes within the window

    def on_crash(self, exit_code: int, now: float) -> Restart | GiveUp:
        """The role exited with ``exit_code`` (not clean) at ``now``: when to start it again, or give up."""
        s = self.settings
        if exit_code == OPERATOR_EXIT:  # a restart would meet the same state and stop again
            return GiveUp(self.role, exit_code, len(self._crashes), s.window_s, s.max_restarts)
        self._crashes.append(now)
        while self._crashes and self._crashes[0] <= now - s.window_s:
            self._crashes.popleft()
        recent = len(self._crashes)
        if recent > s.max_restarts:
            return GiveUp(self.role, exit_code, recent, s.window_s, s.max_restarts)
        delay = min(s.backoff_s * 2 ** (recent - 1), s.backoff_max_s)
        self.restarts += 1
        return Restart(now + delay, delay, self.restarts)
