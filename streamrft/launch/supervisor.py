"""``streamrft run``'s watch over its role processes: a role that crashes is started again with the same command
after the back-off of ``launch.restart`` (``supervision.py`` decides; this carries it out), and a crash loop ends
the run with the role's name, exit and log tail. A restarted role resumes by itself: the explorer from its state
record, a rollout worker from its group's committed offsets, the trainer from its newest checkpoint."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from streamrft.config.supervision import RestartConfig

from .metrics import LauncherMetrics
from .processes import RoleProcess
from .supervision import GiveUp, Restart, RestartPolicy, describe_exit, is_clean

logger = logging.getLogger(__name__)


class Supervisor:
    """``check()`` once per pass of the launcher's loop: it notices crashes, restarts what is due and returns the
    message that stops the run after a crash loop (None otherwise). Each crash and each restart is a log line, and
    a rise of ``metrics`` (the launcher's Prometheus series) when it has them."""

    def __init__(self, processes: list[RoleProcess], settings: RestartConfig,
                 clock: Callable[[], float] = time.monotonic, metrics: LauncherMetrics | None = None):
        self.processes = processes
        self.clock = clock
        self.metrics = metrics
        self.policies = {p.name: RestartPolicy(p.name, settings) for p in processes}
        self.pending: dict[str, Restart] = {}

    def check(self) -> str | None:
        try:
            return self._check(self.clock())
        finally:
            if self.metrics is not None:
                self.metrics.observe(self.processes)

    def _check(self, now: float) -> str | None:
        for process in self.processes:
            if process.name in self.pending:
                if now >= self.pending[process.name].at:
                    self._restart(process, self.pending.pop(process.name))
                continue
            code = process.returncode
            if code is None or is_clean(code):
                continue
            decision = self.policies[process.name].on_crash(code, now)
            if isinstance(decision, GiveUp):
                logger.error("%s: crash loop (%d crashes within %gs), last %s", process.name, decision.crashes,
                             decision.window_s, describe_exit(code))
                return decision.message(process.log_path, process.log_tail())
            self.pending[process.name] = decision
            process.restart_at = decision.at
            logger.warning("%s %s; restarting it in %.1fs (restart %d; its log: %s)", process.name,
                           describe_exit(code), decision.delay, decision.count, process.log_path)
        return None

    def restarts(self) -> dict[str, int]:
        """Restarts per role so far (the roles restarted at least once)."""
        return {name: policy.restarts for name, policy in self.policies.items() if policy.restarts}

    def _restart(self, process: RoleProcess, restart: Restart) -> None:
        process.note_in_log(f"restarted by streamrft run (restart {restart.count}) after a crash")
        process.start()
        process.restarts = restart.count
        process.restart_at = None
        if self.metrics is not None:
            self.metrics.restarted(process.name)
        logger.info("%s restarted (restart %d, pid %d)", process.name, restart.count, process.proc.pid)
