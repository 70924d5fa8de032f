"""DAPO's dynamic sampling on the explorer's side, without a broker (consumers/explorer/dynamic_sampling.py,
rounds.py, schedule.py): which groups count as informative, how many tasks a step's extra rounds add, when a step
may finish, what its state record keeps for a restart, and the metrics and dashboard line it reports."""
from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from streamrft.config import TasksetConfig, load_config
from streamrft.consumers.explorer.dynamic_sampling import DynamicSampling
from streamrft.consumers.explorer.rounds import Round, Window, train_requests
from streamrft.consumers.explorer.schedule import TaskSchedule
from streamrft.consumers.explorer.task_file import FileTaskset, load_taskset_file
from streamrft.errors import ConfigError
from streamrft.explorer_state import ExplorerState
from streamrft.rollout_stats import informative
from streamrft.schemas import InvalidRecordError, RolloutResult, RolloutStatus
from streamrft.selection import Selector

OK, FAILED = RolloutStatus.OK, RolloutStatus.FAILED


def result(request_id: str, rewards: tuple[float, ...] = (0.0, 1.0), status: RolloutStatus = OK) -> RolloutResult:
    return RolloutResult(request_id=request_id, step=0, task_id=request_id, status=status, n=len(rewards),
                         model_version=0, duration_ms=0, reward_mean=sum(rewards) / len(rewards),
                         reward_min=min(rewards), reward_max=max(rewards))


@pytest.mark.parametrize(("rewards", "status", "expected"), [
    ((0.0, 1.0, 1.0), OK, True),
    ((1.0, 1.0, 1.0), OK, False),  # all correct: advantage 0 everywhere
    ((0.0, 0.0), OK, False),  # all wrong
    ((-0.25, -0.5), OK, True),  # equal answers, different overlong penalties: the shaped rewards differ
    ((1.0,), OK, False),  # a single sample has no baseline
    ((0.0, 1.0), FAILED, False),
])
def test_a_group_is_informative_when_its_rewards_differ(rewards, status, expected):
    assert informative(result("r", rewards, status)) is expected


@pytest.mark.parametrize(("accuracy", "n", "expected"), [(0.5, 4, True), (1.0, 4, False), (0.0, 4, False),
                                                         (1.0, 1, False)])
def test_by_accuracy_a_group_is_informative_when_it_is_neither_all_correct_nor_all_wrong(accuracy, n, expected):
    shaped = dataclasses.replace(result("r", (-0.5,) + (0.5,) * (n - 1)), accuracy=accuracy)  # rewards differ
    assert informative(shaped, by="accuracy") is expected


def settings(batch_size: int = 4, max_rounds: int = 2, enabled: bool = True, metric: str = "reward"):
    return load_config(overrides={"explorer": {"batch_size": batch_size, "repeat_times": 2, "dynamic_sampling": {
        "enabled": enabled, "max_rounds": max_rounds, "metric": metric}}}, env={}).explorer


def schedule(tmp_path, count: int, batch_size: int = 4) -> TaskSchedule:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1", "answer": i + 1}) + "\n" for i in range(count)))
    config = TasksetConfig(name="math", path=str(path))
    taskset = FileTaskset(config, load_taskset_file(config), Selector("sequential"), 1)
    return TaskSchedule([taskset], {"math": 1.0}, batch_size, seed=0)


def first_round(tasks: TaskSchedule) -> Round:
    return Round(0, dict(train_requests(0, tasks.take(0), 2, 0, None)))


def answer(round_: Round, rewards: dict[int, tuple[float, ...]], status: RolloutStatus = OK) -> None:
    """Results for the round's requests still missing, by their position among the missing ones."""
    for index, request_id in enumerate(round_.missing):
        round_.results[request_id] = result(request_id, rewards.get(index, (1.0, 1.0)), status)


def test_a_step_short_of_informative_groups_rolls_out_exactly_the_missing_number_until_its_rounds_run_out(tmp_path):
    tasks, sampling = schedule(tmp_path, 20), DynamicSampling(settings(max_rounds=2))
    round_ = first_round(tasks)
    assert sampling.top_up(round_, tasks, 0, None) == []  # results missing: nothing to decide yet
    answer(round_, {0: (0.0, 1.0), 1: (1.0, 0.0)})  # 2 informative, 2 all-correct
    more = sampling.top_up(round_, tasks, min_model_version=3, deadline_ms=None)
    assert [r.task.task_id for r in more] == ["math-5", "math-6"]  # the 2 missing, the tasks after the first 4
    assert {r.step for r in more} == {0} and {r.min_model_version for r in more} == {3}
    assert round_.oversampled == 1 and round_.missing == [r.request_id for r in more]
    assert sampling.top_up(round_, tasks, 0, None) == []  # while those are out

    answer(round_, {0: (0.0, 1.0)})  # 1 of the 2 is informative: 3 of 4
    assert [r.task.task_id for r in sampling.top_up(round_, tasks, 0, None)] == ["math-7"]
    answer(round_, {})  # uniform again; max_rounds 2 reached: the step finishes with 3 informative groups
    assert sampling.wanted(round_) == 0 and sampling.top_up(round_, tasks, 0, None) == [] and not round_.wants_tasks
    assert sampling.metrics(round_) == {"rollout/informative_groups": 3.0, "rollout/filtered_groups": 4.0,
                                        "rollout/oversample_rounds": 2.0}
    assert len(round_.requests) == 7  # never more informative groups than batch_size: no surplus to train later


def test_failed_tasks_are_refilled_and_a_full_step_wants_nothing(tmp_path):
    tasks, sampling = schedule(tmp_path, 20), DynamicSampling(settings())
    round_ = first_round(tasks)
    answer(round_, {0: (0.0, 1.0), 1: (0.0, 1.0), 2: (0.0, 1.0)}, status=OK)
    last = list(round_.requests)[3]
    round_.results[last] = result(last, status=FAILED)
    assert sampling.wanted(round_) == 1  # the failed task's place is filled like a filtered group's
    (refill,) = sampling.top_up(round_, tasks, 0, None)
    answer(round_, {0: (0.0, 1.0)})
    assert sampling.wanted(round_) == 0 and round_.missing == []
    assert sampling.metrics(round_) == {"rollout/informative_groups": 4.0, "rollout/filtered_groups": 0.0,
                                        "rollout/oversample_rounds": 1.0}  # a failed task is not a filtered group


def test_a_step_with_no_informative_group_goes_on_past_max_rounds_while_tasks_remain(tmp_path):
    tasks, sampling = schedule(tmp_path, 10), DynamicSampling(settings(max_rounds=1))
    round_ = first_round(tasks)
    answer(round_, {})  # all uniform
    assert len(sampling.top_up(round_, tasks, 0, None)) == 4
    answer(round_, {})
    assert len(sampling.top_up(round_, tasks, 0, None)) == 2  # past max_rounds; the last 2 tasks
    assert round_.oversampled == 2
    answer(round_, {})
    assert sampling.top_up(round_, tasks, 0, None) == [] and tasks.exhausted
    assert not round_.wants_tasks  # out of tasks: the step finishes empty-handed


def test_a_step_waiting_for_tasks_does_not_finish_until_they_come_or_it_times_out(tmp_path):
    explorer = settings()
    window, sampling = Window(explorer), DynamicSampling(explorer)
    round_ = Round(0, dict(train_requests(0, schedule(tmp_path, 4).take(0), 2, 0, None)))
    window.add(round_)
    answer(round_, {})
    idle = SimpleNamespace(ready=lambda wait: False, exhausted=False)  # a streaming topic with nothing in it
    assert sampling.top_up(round_, idle, 0, None) == [] and round_.wants_tasks
    now = time.monotonic()
    assert window.pop_finishable(now) is None
    assert window.pop_finishable(now + explorer.step_timeout_s) is round_  # step_timeout_s bounds the wait


def test_by_accuracy_the_step_counts_the_groups_neither_all_correct_nor_all_wrong(tmp_path):
    tasks, sampling = schedule(tmp_path, 20), DynamicSampling(settings(metric="accuracy"))
    round_ = first_round(tasks)
    answer(round_, {0: (0.0, 1.0), 1: (0.0, 1.0), 2: (0.0, 1.0), 3: (0.0, 1.0)})  # every group's rewards differ
    for index, request_id in enumerate(round_.requests):  # but two of the groups are all correct
        round_.results[request_id] = dataclasses.replace(round_.results[request_id], accuracy=(0.5, 1.0)[index % 2])
    assert sampling.wanted(round_) == 2
    assert sampling.metrics(round_)["rollout/filtered_groups"] == 2.0


def test_disabled_it_wants_nothing_and_reports_nothing(tmp_path):
    tasks, sampling = schedule(tmp_path, 8), DynamicSampling(settings(enabled=False))
    round_ = first_round(tasks)
    answer(round_, {})
    assert sampling.top_up(round_, tasks, 0, None) == [] and sampling.metrics(round_) == {}
    eval_round = Round(0, {"e": None}, eval_taskset="arith")
    eval_round.results["e"] = result("e", (1.0, 1.0))
    assert DynamicSampling(settings()).wanted(eval_round) == 0  # eval rounds are never filled


def test_the_state_record_keeps_a_steps_rounds_for_a_restart():
    round_ = Round(3, dict.fromkeys(["s3-e0-a", "s3-e0-b"]), {"0": 5}, oversampled=2)
    entry = round_.entry()
    assert entry == {"step": 3, "requests": ["s3-e0-a", "s3-e0-b"], "results_offsets": {"0": 5}, "oversampled": 2}
    state = ExplorerState.from_json(ExplorerState(next_step=4, in_flight=[entry]).to_json())
    restored = Round.of(state.in_flight[0])
    assert (restored.step, list(restored.requests), restored.oversampled) == (3, ["s3-e0-a", "s3-e0-b"], 2)
    assert "oversampled" not in Round(0, {}).entry()  # a step that was never filled writes what it always did
    for bad in (-1, "2", True):
        with pytest.raises(InvalidRecordError, match="oversampled"):
            ExplorerState.from_json(ExplorerState(next_step=4, in_flight=[{**entry, "oversampled": bad}]).to_json())


def test_an_extra_rounds_request_ids_never_repeat_the_steps_earlier_ones(tmp_path):
    tasks = schedule(tmp_path, 3, batch_size=2)
    first = train_requests(0, tasks.take(0), 2, 0, None)
    assert list(first) == ["s0-e0-math-1", "s0-e0-math-2"]
    again = train_requests(0, [(0, first["s0-e0-math-1"].task)], 2, 0, None, taken=first)
    (request_id,) = again
    assert request_id not in first and request_id.startswith("s0-e0-math-1-math-")


def test_an_extra_round_takes_its_count_with_a_draw_of_its_own(tmp_path):
    def two_tasksets():
        sets = []
        for name in ("a", "b"):
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps({"question": f"{i}", "answer": i}) + "\n" for i in range(200)))
            config = TasksetConfig(name=name, path=str(path))
            sets.append(FileTaskset(config, load_taskset_file(config), Selector("sequential"), None))
        return TaskSchedule(sets, {"a": 1.0, "b": 1.0}, batch_size=16, seed=0)

    draws = [[t.taskset for _, t in two_tasksets().take(5, count=12, draw=d)] for d in (0, 1, 1)]
    assert [len(d) for d in draws] == [12, 12, 12]
    assert draws[1] == draws[2] and draws[0] != draws[1]  # seeded by the round: a restart draws the same


def test_dynamic_sampling_and_over_rollout_are_refused_together():
    with pytest.raises(ConfigError, match="over_rollout.ratio: 0 or dynamic_sampling.enabled: false"):
        load_config(overrides={"explorer": {"over_rollout": {"ratio": 0.25}, "dynamic_sampling": {"enabled": True}}},
                    env={})


def test_the_dashboard_shows_the_last_steps_dynamic_sampling_and_the_overlong_share():
    from streamrft.launch.dashboard import MetricsHistory, render

    follower = MetricsHistory()
    for name, value in {"rollout/reward_mean": 0.5, "rollout/ok": 12, "rollout/tasks": 12, "time/step_s": 3.0,
                        "rollout/informative_groups": 8, "rollout/filtered_groups": 4,
                        "rollout/oversample_rounds": 1}.items():
        follower.add("explorer", 0, name, value)
    follower.latest.update({"rollout_worker/overlong_punished_frac": 0.125,
                            "rollout_worker/overlong_penalty_mean": -0.04})
    console = Console(record=True, width=160)
    console.print(render(follower, {}, [], time.monotonic(), "dapo"))
    text = console.export_text()
    assert "last step 8 groups trained, 4 filtered, 1 extra round(s)" in text
    assert "12% punished, mean -0.040" in text


def test_a_filled_step_waits_for_every_result_though_batch_size_of_them_are_in(tmp_path):
    explorer = settings()  # over_rollout.ratio 0: a step finishes with all its results
    window, tasks = Window(explorer), schedule(tmp_path, 20)
    round_ = Round(0, dict(train_requests(0, tasks.take(0, count=6), 2, 0, None)))
    window.add(round_)
    for request_id in list(round_.requests)[:4]:
        round_.results[request_id] = result(request_id)
    assert window.pop_finishable(time.monotonic()) is None
    answer(round_, {})
    assert window.pop_finishable(time.monotonic()) is round_
