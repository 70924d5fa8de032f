"""Role processes started by ``streamrft run``: each is ``python -m streamrft.cli <role> CONFIG`` with its
output in a log file, dies with its parent (Linux parent-death signal), and stops gracefully (SIGTERM), then
forcibly (SIGKILL) after a timeout."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..lifecycle import die_with_parent

logger = logging.getLogger(__name__)


@dataclass
class RoleProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0  # by the launcher's supervisor (supervisor.py), after crashes
    restart_at: float | None = None  # monotonic time of a restart that is waiting out its back-off

    def start(self) -> "RoleProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops each role once.
        self.proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", *self.argv], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env}, start_new_session=True,
                                     preexec_fn=die_with_parent)
        log.close()
        logger.debug("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running:
            self.proc.kill()

    def note_in_log(self, line: str) -> None:
        """A line of the launcher's in the role's log, so that a reader sees where one process ends and the next
        begins."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {line} ----\n")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stop_all(processes: list[RoleProcess], timeout: float = 60.0) -> None:
    """Graceful stop (SIGTERM: each role finishes its unit of work, checkpoints, leaves its group), then
    SIGKILL whatever is still running after ``timeout`` seconds."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout
    while any(p.running for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in processes:
        if process.running:
            logger.warning("%s did not stop within %.0fs; killing it", process.name, timeout)
            process.kill()
            process.proc.wait(10)
