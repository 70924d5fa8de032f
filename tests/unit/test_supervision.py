"""The restart policy of `streamrft run` (launch.restart) with made-up times: back-off that doubles to a cap, a
crash loop that gives up with the role, its exit and its log tail, and clean exits that are never restarted; the
supervisor that carries it out, on stand-in processes and an injected clock; what the dashboard says."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamrft.config import load_config
from streamrft.config.supervision import RestartConfig
from streamrft.errors import OPERATOR_EXIT, ConfigError, OperatorNeeded
from streamrft.launch.dashboard import role_state
from streamrft.launch.supervision import GiveUp, Restart, RestartPolicy, describe_exit, is_clean
from streamrft.launch.supervisor import Supervisor

SETTINGS = RestartConfig(max_restarts=3, window_s=60, backoff_s=1, backoff_max_s=3)


def test_back_off_doubles_from_backoff_s_to_the_cap():
    policy = RestartPolicy("explorer", RestartConfig(max_restarts=10, window_s=600, backoff_s=1, backoff_max_s=5))
    delays = [policy.on_crash(1, now).delay for now in (0, 2, 5, 10, 20, 40)]
    assert delays == [1, 2, 4, 5, 5, 5]
    assert policy.restarts == 6


def test_a_crash_loop_gives_up_naming_the_role_its_exit_and_its_log_tail():
    policy = RestartPolicy("rollout-1", SETTINGS)
    decisions = [policy.on_crash(-9, now) for now in (0.0, 5.0, 10.0)]
    assert [d.at for d in decisions] == [1.0, 7.0, 13.0]  # back-offs 1, 2, then 4 capped at 3 s
    assert [d.count for d in decisions] == [1, 2, 3]
    gave_up = policy.on_crash(-9, 20.0)
    assert isinstance(gave_up, GiveUp) and gave_up.crashes == 4
    message = gave_up.message(Path("runs/demo/logs/rollout-1.log"), "Traceback ...\nRuntimeError: boom")
    assert "rollout-1 crashed 4 times within 60s" in message and "max_restarts is 3" in message
    assert "killed by SIGKILL (-9)" in message and "runs/demo/logs/rollout-1.log" in message
    assert message.index("RuntimeError: boom") > message.index("ends with") and "--resume" in message


def test_crashes_older_than_the_window_are_forgotten_and_the_back_off_starts_again():
    policy = RestartPolicy("trainer", SETTINGS)
    for now in (0, 10, 20):
        assert isinstance(policy.on_crash(1, now), Restart)
    later = policy.on_crash(1, 200.0)  # the three earlier crashes are out of the 60 s window
    assert isinstance(later, Restart) and later.delay == 1 and later.count == 4


def test_max_restarts_zero_stops_the_run_at_the_first_crash():
    assert isinstance(RestartPolicy("monitor", RestartConfig(max_restarts=0)).on_crash(2, 0.0), GiveUp)


def test_a_role_stopped_for_an_operators_decision_is_not_restarted_and_the_run_says_what_to_do():
    policy = RestartPolicy("trainer", SETTINGS)
    assert isinstance(policy.on_crash(1, 0.0), Restart)  # an ordinary crash first
    decision = policy.on_crash(OPERATOR_EXIT, 10.0)
    assert isinstance(decision, GiveUp) and policy.restarts == 1
    message = decision.message("logs/trainer.log", "... accept the reset: --accept-offset-reset")
    assert "trainer stopped for an operator's decision (exit code 78) and is not restarted" in message
    assert "--accept-offset-reset" in message and "crashed" not in message


def test_operator_errors_exit_with_78_and_other_explained_errors_with_2(monkeypatch, capsys):
    from streamrft import cli

    def fail_with(error):
        def run(_args):
            raise error
        return run

    for error, code in ((OperatorNeeded("group moved; --accept-offset-reset"), OPERATOR_EXIT),
                        (ConfigError("bad key"), 2)):
        monkeypatch.setattr(cli, "build_parser", lambda _names, e=error: _Parsed(fail_with(e)))
        assert cli.main(["tasks"]) == code
    assert "streamrft: stopped: group moved" in capsys.readouterr().err


class _Parsed:
    """A parser whose parse gives args that run ``func``."""

    def __init__(self, func):
        self.func = func

    def parse_args(self, _argv):
        import argparse

        return argparse.Namespace(func=self.func, verbose=0)


def test_only_exit_code_zero_is_clean_and_exits_are_described():
    assert is_clean(0) and not is_clean(1) and not is_clean(-9) and not is_clean(2)
    assert describe_exit(1) == "exit code 1" and describe_exit(-15) == "killed by SIGTERM (-15)"


def test_restart_settings_are_checked_with_what_to_change():
    config = load_config(overrides={"launch": {"restart": {"max_restarts": 2, "window_s": 30}}}, env={})
    assert config.launch.restart.max_restarts == 2 and config.launch.restart.backoff_max_s == 30
    with pytest.raises(ConfigError, match="backoff_max_s .* must be at least backoff_s"):
        load_config(overrides={"launch": {"restart": {"backoff_s": 10, "backoff_max_s": 5}}}, env={})
    with pytest.raises(ConfigError, match="launch.restart.max_restarts"):
        load_config(overrides={"launch": {"restart": {"max_restarts": -1}}}, env={})


class _Process:
    """A role process as the supervisor sees it: an exit code that the test sets, a start that brings it back."""

    def __init__(self, name: str, tmp_path: Path):
        self.name = name
        self.log_path = tmp_path / f"{name}.log"
        self.log_path.write_text("loading\nValueError: bad luck\n")
        self.returncode: int | None = None
        self.restarts = 0
        self.restart_at = None
        self.starts = 0
        self.proc = type("Popen", (), {"pid": 4242})()

    @property
    def running(self) -> bool:
        return self.returncode is None

    def start(self):
        self.starts += 1
        self.returncode = None
        return self

    def note_in_log(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"---- {line} ----\n")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])


def test_the_supervisor_restarts_a_crashed_role_after_its_back_off_and_leaves_clean_exits_alone(tmp_path, caplog):
    clock = [100.0]
    worker, explorer = _Process("rollout-0", tmp_path), _Process("explorer", tmp_path)
    supervisor = Supervisor([explorer, worker], SETTINGS, clock=lambda: clock[0])
    explorer.returncode = 0  # the explorer finished its steps: not a crash
    worker.returncode = -9
    with caplog.at_level("INFO", logger="streamrft.launch.supervisor"):
        assert supervisor.check() is None
    assert worker.starts == 0 and "rollout-0 killed by SIGKILL (-9); restarting it in 1.0s (restart 1" in caplog.text
    assert role_state(worker, now=100.2) == "killed by SIGKILL (-9), restarting in 1s, restarts: 0"
    clock[0] = 100.5
    supervisor.check()
    assert worker.starts == 0  # still backing off
    clock[0] = 101.0
    with caplog.at_level("INFO", logger="streamrft.launch.supervisor"):
        supervisor.check()
    assert worker.starts == 1 and worker.restarts == 1 and worker.running
    assert "rollout-0 restarted (restart 1, pid 4242)" in caplog.text
    assert role_state(worker) == "running, restarts: 1" and role_state(explorer) == "exited 0, restarts: 0"
    assert "restarted by streamrft run (restart 1) after a crash" in worker.log_path.read_text()
    assert explorer.starts == 0 and supervisor.restarts() == {"rollout-0": 1}


def test_the_supervisor_returns_the_crash_loop_message_with_the_log_tail(tmp_path):
    clock = [0.0]
    trainer = _Process("trainer", tmp_path)
    supervisor = Supervisor([trainer], RestartConfig(max_restarts=1, backoff_s=0, backoff_max_s=0),
                            clock=lambda: clock[0])
    trainer.returncode = 1
    assert supervisor.check() is None  # the crash: restart due at once
    supervisor.check()  # the restart
    assert trainer.starts == 1
    trainer.returncode = 1
    clock[0] = 5.0
    message = supervisor.check()
    assert message is not None and "trainer crashed 2 times" in message and "exit code 1" in message
    assert "ValueError: bad luck" in message and str(trainer.log_path) in message


def test_the_launcher_counts_restarts_and_roles_up_on_its_prometheus_endpoint(tmp_path):
    """streamrft_role_restarts_total and streamrft_role_up, scraped over HTTP from the launcher's endpoint while
    the supervisor restarts a stand-in role."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from streamrft.launch.metrics import LauncherMetrics
    from streamrft.telemetry import serve_prometheus

    clock = [0.0]
    worker, trainer = _Process("rollout-0", tmp_path), _Process("trainer", tmp_path)
    worker.returncode = trainer.returncode = None
    metrics = LauncherMetrics([worker.name, trainer.name])
    endpoint = serve_prometheus(0, metrics.registry)
    supervisor = Supervisor([worker, trainer], SETTINGS, clock=lambda: clock[0], metrics=metrics)

    def scraped() -> dict[tuple[str, str], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return {(s.name, s.labels["role"]): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name in ("streamrft_role_restarts_total", "streamrft_role_up")}

    try:
        supervisor.check()
        assert scraped() == {("streamrft_role_restarts_total", "rollout-0"): 0, ("streamrft_role_up", "rollout-0"): 1,
                             ("streamrft_role_restarts_total", "trainer"): 0, ("streamrft_role_up", "trainer"): 1}
        worker.returncode = -9
        supervisor.check()  # the crash: down, backing off
        assert scraped()[("streamrft_role_up", "rollout-0")] == 0
        for _ in range(2):  # restarted, then killed again and restarted after the doubled back-off
            clock[0] += 5
            supervisor.check()
            assert worker.running
            worker.returncode = -9
            supervisor.check()
        clock[0] += 5
        supervisor.check()
        got = scraped()
        assert got[("streamrft_role_restarts_total", "rollout-0")] == 3 == worker.restarts
        assert got[("streamrft_role_up", "rollout-0")] == 1 and got[("streamrft_role_up", "trainer")] == 1
        assert got[("streamrft_role_restarts_total", "trainer")] == 0
    finally:
        endpoint.close()
