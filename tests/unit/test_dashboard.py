"""The live dashboard of `streamrft run` renders what the metrics say (no broker: a stand-in follower)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from rich.console import Console

from streamrft.launch.dashboard import KEEP_STEPS, MetricsHistory, render


def history_of(by_role: dict, latest: dict | None = None) -> MetricsHistory:
    """The history a follower would hold after reading these values, in step order."""
    history = MetricsHistory()
    for role, steps in by_role.items():
        for step in sorted(steps):
            for name, value in steps[step].items():
                history.add(role, step, name, value)
    history.latest.update(latest or {})
    return history


def test_dashboard_shows_steps_trainer_figures_lag_and_processes():
    follower = history_of({"explorer": {
        0: {"rollout/reward_mean": 0.047, "rollout/accuracy": 0.047, "rollout/model_version": 0,
            "rollout/staleness": 0, "rollout/ok": 8, "rollout/tasks": 8, "time/step_s": 18.5},
        1: {"rollout/reward_mean": 0.172, "rollout/accuracy": 0.172, "rollout/model_version": 0,
            "rollout/staleness": 1, "rollout/ok": 7, "rollout/tasks": 8, "time/step_s": 94.5},
    }, "trainer": {0: {"actor/pg_loss": 0.0123, "actor/kl": 0.0004}}},
        {"rollout_worker/samples_per_s": 3.4, "actor/grad_norm": 0.5, "actor/lr": 1e-5})
    processes = [SimpleNamespace(name="explorer", running=True, returncode=None),
                 SimpleNamespace(name="rollout-0", running=False, returncode=1)]
    console = Console(record=True, width=160)
    console.print(render(follower, {"trainer": 64}, processes, time.monotonic() - 90, "demo"))
    text = console.export_text()
    assert "streamrft run demo" in text and "1.5 min" in text
    assert "0.172" in text and "7/8" in text and "94.5" in text
    assert "0.0123" in text  # trainer step 0 trained explorer step 0's experiences: on the same row
    assert "lag trainer" in text and "64" in text
    assert "exited 1" in text and "3.4" in text


def test_dashboard_shows_progress_with_an_eta_the_latest_eval_round_and_the_sync_style():
    from streamrft.config import load_config
    from streamrft.launch.dashboard import progress, sync_line

    follower = history_of({"explorer": {
        0: {"time/step_s": 10.0, "eval/mini/mean@4": 0.25, "eval/mini/best@4": 0.5},
        1: {"time/step_s": 10.0},
        2: {"time/step_s": 10.0, "eval/mini/mean@4": 0.375, "eval/mini/best@4": 0.75},
        3: {"time/step_s": 10.0},
    }})
    console = Console(record=True, width=160)
    config = load_config(overrides={"sync": {"style": "trainer_driven", "max_staleness": 2}}, env={})
    console.print(render(follower, {}, [], time.monotonic() - 120, "demo", max_steps=10, sync=sync_line(config)))
    text = console.export_text()
    assert "4/10 steps, ETA 1.0 min" in text  # 6 more steps of 10 s (the recent steps' pace, not the uptime's)
    assert "eval mini (after step 2)" in text and "best@4 0.750, mean@4 0.375" in text
    assert "trainer_driven: at most 2 step(s) ahead of the weights the trainer requested" in text
    assert progress(0, 10, []) == "0/10 steps" and progress(3, None, [5.0]) == "3 steps"
    assert progress(38, 40, [30.0, 90.0]) == "38/40 steps, ETA 2.0 min"


def test_dashboard_says_which_steps_are_in_flight_and_what_the_next_one_waits_for():
    from streamrft.config import load_config
    from streamrft.launch.dashboard import sync_line
    from streamrft.explorer_state import ExplorerState

    config = load_config(overrides={"sync": {"style": "fully_async", "max_staleness": 2},
                                    "explorer": {"max_inflight_steps": 3}}, env={})
    state = ExplorerState(next_step=7, finished_step=3, waiting="weights v5 (has v4)",
                          in_flight=[{"step": 4, "requests": []}, {"step": 5, "requests": []},
                                     {"step": 3, "requests": [], "eval": "mini"}, {"step": 6, "requests": []}])
    line = sync_line(config, state)
    assert line.startswith("fully_async: at most 2 step(s) ahead of the weights, up to 3 step(s) in flight")
    assert line.endswith("in flight: 4, 5, 6; step 7 waits for weights v5 (has v4)")
    assert sync_line(config, ExplorerState(next_step=2, finished_step=1)).endswith("in flight: none")

    explorer = {s: {"time/step_s": 30.0, "time/step_interval_s": 10.0} for s in range(4)}  # 3 steps in flight:
    explorer[-1] = {"eval/mini/mean@4": 0.125}  # each takes 30 s, one finishes every 10 s
    follower = history_of({"explorer": explorer})
    console = Console(record=True, width=160)
    console.print(render(follower, {}, [], time.monotonic(), "demo", max_steps=10, sync=line))
    text = console.export_text()
    assert "ETA 1.0 min" in text and "eval mini (base model)" in text and "waits for weights v5" in text


def test_dashboard_shows_each_tasksets_share_and_latest_accuracy():
    follower = history_of({"explorer": {
        0: {"time/step_s": 5.0, "rollout/taskset/math/tasks": 6, "rollout/taskset/math/accuracy": 0.25,
            "rollout/taskset/chat/tasks": 2, "rollout/taskset/chat/accuracy": 0.5},
        1: {"time/step_s": 5.0, "rollout/taskset/math/tasks": 5, "rollout/taskset/math/accuracy": 0.375,
            "rollout/taskset/chat/tasks": 3, "rollout/taskset/chat/accuracy": 0.125},
    }})
    console = Console(record=True, width=160)
    console.print(render(follower, {}, [], time.monotonic(), "mix"))
    text = console.export_text()
    assert "taskset math" in text and "11 tasks, accuracy 0.375" in text
    assert "taskset chat" in text and "5 tasks, accuracy 0.125" in text


def test_the_history_keeps_recent_steps_only_and_folds_what_the_view_sums_over_the_run():
    history = MetricsHistory()
    steps = 20 * KEEP_STEPS
    for step in range(-1, steps):
        if step < 0:
            history.add("explorer", step, "eval/mini/mean@4", 0.1)
            continue
        history.add("explorer", step, "time/step_s", 1.0)
        history.add("explorer", step, "rollout/taskset/math/tasks", 4.0)
        history.add("explorer", step, "rollout/taskset/math/accuracy", step / steps)
        history.add("trainer", step, "actor/pg_loss", 0.5)
        if step % 100 == 99:
            history.add("explorer", step, "eval/mini/mean@4", step / steps)
    assert len(history.by_role["explorer"]) == len(history.by_role["trainer"]) == KEEP_STEPS
    assert min(history.by_role["explorer"]) == steps - KEEP_STEPS
    assert history.steps_finished == steps and history.taskset_tasks == {"math": 4.0 * steps}
    last_eval = max(s for s in range(steps) if s % 100 == 99)
    assert history.evals == {"mini": (last_eval, {"mean@4": last_eval / steps})}
    history.add("explorer", steps - 1, "time/step_s", 1.0)  # a value read again (a re-read) counts once
    assert history.steps_finished == steps
    console = Console(record=True, width=160)
    console.print(render(history, {}, [], time.monotonic(), "long", max_steps=steps + 10))
    text = console.export_text()
    assert f"{steps}/{steps + 10} steps" in text and f"{4 * steps} tasks" in text
    assert f"eval mini (after step {last_eval})" in text
