"""Task scheduling without a broker (consumers/explorer/schedule.py, task_file.py): file-fed tasksets mixed by
weight, each in its own order, positions that resume exactly, and the difficulty order that leaves solved tasks
behind."""
from __future__ import annotations

import json
import math

import pytest

from streamrft.config import TasksetConfig, TasksetOrder, load_config
from streamrft.consumers.explorer.schedule import TaskSchedule, configured_tasksets
from streamrft.consumers.explorer.task_file import FileTaskset, load_taskset_file
from streamrft.errors import ConfigError
from streamrft.schemas import RolloutResult, RolloutStatus
from streamrft.selection import Selector


def task_file(tmp_path, name: str, count: int, **extra) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"question": f"{name} {i}", "answer": i, "level": (i * 7) % count, **extra})
                            + "\n" for i in range(count)))
    return str(path)


def file_taskset(tmp_path, name: str, count: int, *, epochs: int | None = 1, **settings) -> FileTaskset:
    config = TasksetConfig(name=name, path=task_file(tmp_path, name, count), **settings)
    order = config.order
    return FileTaskset(config, load_taskset_file(config), Selector(order.kind, order.seed, order.field,
                                                                   order.descending), epochs)


def schedule(tasksets, weights, batch_size=8, seed=0) -> TaskSchedule:
    return TaskSchedule(tasksets, weights, batch_size, seed)


def ids(batch) -> list[str]:
    return [task.task_id for _, task in batch]


def test_two_tasksets_mixed_three_to_one_follow_their_weights_within_a_binomial_bound(tmp_path):
    mix = schedule([file_taskset(tmp_path, "math", 400, epochs=None), file_taskset(tmp_path, "code", 400, epochs=None)],
                   {"math": 3.0, "code": 1.0}, batch_size=16)
    drawn = [task.taskset for step in range(50) for _, task in mix.take(step)]
    assert len(drawn) == 800
    share, n, p = drawn.count("math") / len(drawn), len(drawn), 0.75
    assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n)  # 4 standard deviations: fails by chance ~1 in 16,000


def test_each_taskset_hands_out_its_tasks_once_per_epoch_in_its_own_order(tmp_path):
    sequential = file_taskset(tmp_path, "a", 10, epochs=2)
    by_level = file_taskset(tmp_path, "b", 10, epochs=1, order=TasksetOrder(kind="field", field="level"))
    a = ids(sequential.take(10)) + ids(sequential.take(10))
    assert a == [f"a-{i}" for i in range(1, 11)] * 2 and not sequential.exhausted
    assert sequential.take(1) == [] and sequential.exhausted
    levels = [json.loads(task.payload)["level"] for _, task in by_level.take(10)]
    assert levels == sorted(levels)  # a curriculum: by the payload's field


def test_a_restored_schedule_draws_and_hands_out_what_the_first_would_have(tmp_path):
    def build():
        return schedule([file_taskset(tmp_path, "math", 30, epochs=3, order=TasksetOrder(kind="shuffle", seed=4)),
                         file_taskset(tmp_path, "code", 12, epochs=3)], {"math": 2.0, "code": 1.0}, batch_size=5)

    reference = build()
    whole = [ids(reference.take(step)) for step in range(20)]
    first = build()
    before = [ids(first.take(step)) for step in range(7)]
    positions = json.loads(json.dumps(first.positions()))  # as the state record holds them
    resumed = build()
    resumed.restore(positions, blocks_before=0)
    after = [ids(resumed.take(step)) for step in range(7, 20)]
    assert before + after == whole


def test_a_taskset_that_runs_out_leaves_its_share_to_the_others(tmp_path):
    mix = schedule([file_taskset(tmp_path, "small", 3), file_taskset(tmp_path, "big", 100)],
                   {"small": 10.0, "big": 1.0}, batch_size=8)
    first = mix.take(0)
    assert len(first) == 8 and sum(task.taskset == "small" for _, task in first) == 3  # all it had
    assert all(task.taskset == "big" for _, task in mix.take(1))


def solve(tasks, solvable) -> list[RolloutResult]:
    return [RolloutResult(request_id=t.task_id, step=0, task_id=t.task_id, status=RolloutStatus.OK, n=4,
                          model_version=0, duration_ms=1, accuracy=1.0 if solvable(t) else 0.0) for t in tasks]


def test_difficulty_puts_failed_tasks_first_and_skip_solved_leaves_solved_ones_behind(tmp_path):
    taskset = file_taskset(tmp_path, "mixed", 20, epochs=3,
                           order=TasksetOrder(kind="difficulty", skip_solved=True))
    solvable = lambda task: int(task.task_id.rsplit("-", 1)[1]) % 2 == 0  # noqa: E731 - half of them
    first_epoch = [task for _, task in taskset.take(20)]
    for result in solve(first_epoch, solvable):
        taskset.observe(result)
    second_epoch = [task for _, task in taskset.take(10)]
    assert len(second_epoch) == 10 and not any(solvable(t) for t in second_epoch)  # the failed ones first
    next_one = taskset.take(1)
    assert taskset.skipped == 10  # the solved ones were passed over ...
    assert next_one[0][0] == 2 and not solvable(next_one[0][1])  # ... to the third epoch's failed ones


def test_tasksets_config_is_checked_at_start(tmp_path):
    path = task_file(tmp_path, "m", 3)
    with pytest.raises(ConfigError, match="exactly one source"):
        load_config(overrides={"explorer": {"tasksets": [{"name": "m", "path": path, "topic": "x"}]}}, env={})
    with pytest.raises(ConfigError, match="own name"):
        load_config(overrides={"explorer": {"tasksets": [{"name": "m", "path": path}, {"name": "m", "topic": "x"}]}},
                    env={})
    with pytest.raises(ConfigError, match="skip_solved applies to order kind difficulty"):
        load_config(overrides={"explorer": {"tasksets": [{"name": "m", "path": path,
                                                          "order": {"skip_solved": True}}]}}, env={})


def test_a_run_without_tasksets_has_the_tasks_topic_in_the_selectors_order():
    config = load_config(overrides={"explorer": {"selector": {"kind": "difficulty", "seed": 3}}}, env={})
    (only,) = configured_tasksets(config)
    assert (only.name, only.topic_suffix, only.order.kind, only.order.seed) == ("tasks", "tasks", "learnable", 3)


def test_topic_fed_tasksets_get_topics_and_acls_of_their_own(tmp_path):
    from streamrft.acls import role_acls

    config = load_config(overrides={"name": "mix", "explorer": {"tasksets": [
        {"name": "chat", "topic": "chat"}, {"name": "base", "topic": "tasks"},
        {"name": "m", "path": task_file(tmp_path, "m", 3)}]}}, env={})
    assert config.topics_of("tasks") == ["rft.mix.tasks", "rft.mix.tasks.chat"]
    assert {"rft.mix.tasks.chat", "rft.mix.tasks.chat.dlq"} <= set(config.topic_layouts())
    readable = {acl.name for acl in role_acls(config, "explorer") if acl.operation == "read"}
    writable = {acl.name for acl in role_acls(config, "tasks") if acl.operation == "write"}
    assert {"rft.mix.tasks", "rft.mix.tasks.chat"} <= readable and {"rft.mix.tasks", "rft.mix.tasks.chat"} == writable


def test_tasks_produce_sends_a_topic_fed_tasksets_tasks_to_its_topic(tmp_path):
    from streamrft.commands.tasks import _topic_of

    config = load_config(overrides={"name": "mix", "explorer": {"tasksets": [
        {"name": "chat", "topic": "chat"}, {"name": "m", "path": task_file(tmp_path, "m", 3)}]}}, env={})
    assert _topic_of(config, "chat") == "rft.mix.tasks.chat"
    assert _topic_of(config, "anything-else") == "rft.mix.tasks"
    with pytest.raises(ConfigError, match="read from the file"):
        _topic_of(config, "m")
