"""The monitor's table holds a window of recent steps, not the run, and still writes the files the whole run's
table would: metrics.csv (one row per (source, name, step), first position, last value) and steps.csv (one row
per step). The expected files are built here from every value, the way the unbounded table wrote them."""
from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from streamrft.consumers import metric_table
from streamrft.consumers.metric_table import MetricTable
from streamrft.schemas import Metric

T0 = 1_700_000_000_000
# the steps.csv columns of the metrics below: the explorer's (by name) first, then the trainer's
WIDE = {"explorer": ("rollout/", "time/", "eval/"), "trainer": ("actor/", "trainer/")}


class Unbounded:
    """Every value of the run, as the table that held them all wrote them."""

    def __init__(self):
        self.rows: dict[tuple, tuple] = {}

    def add(self, m: Metric) -> None:
        self.rows[(m.source, m.name, m.step)] = (m.step, m.role, m.source, m.name, float(m.value), m.created_at)

    def long_text(self) -> str:
        return _csv([["step", "role", "source", "name", "value", "created_at"]]
                    + [[str(s), role, source, name, repr(v), str(at)] for s, role, source, name, v, at in
                       self.rows.values()])

    def wide_text(self) -> str:
        wide: dict[int, dict[str, float]] = {}
        names: dict[str, set[str]] = {role: set() for role in WIDE}
        for step, role, _, name, value, _ in self.rows.values():
            if name.startswith(WIDE.get(role, ())):
                wide.setdefault(step, {})[name] = value
                names[role].add(name)
        columns = sorted(names["explorer"]) + sorted(names["trainer"])
        return _csv([["step", *columns]] + [[str(step)] + [repr(v[c]) if c in v else "" for c in columns]
                                            for step, v in sorted(wide.items())])


def _csv(rows: list[list[str]]) -> str:
    text = io.StringIO()
    csv.writer(text).writerows(rows)
    return text.getvalue()


def _text(path: Path) -> str:
    return path.read_bytes().decode()


def _step(step: int, trainer_shift: float = 0.0) -> list[Metric]:
    """One explorer step, the trainer's values of the step before (it trails), two rollout workers, an eval
    every 100 steps and, from step 2500, a trainer metric that was not there before (a new column)."""
    at = T0 + step * 1000
    out = [Metric("explorer", "explorer", name, value, step, {}, at) for name, value in
           {"rollout/reward_mean": step / 5000, "rollout/accuracy": (step % 7) / 7, "time/step_s": 2.0}.items()]
    out += [Metric(w, "rollout", "rollout_worker/batch_ms", 100.0 + step % 13, step, {}, at) for w in ("w0", "w1")]
    if step % 100 == 0:
        out.append(Metric("explorer", "explorer", "eval/x/mean@4", step / 10_000, step, {}, at))
    if step > 0:
        trained = {"actor/pg_loss": -step / 1e4 + trainer_shift, "actor/kl": 1e-3, "trainer/staleness": 0.5,
                   "time/train_step": 1.5}
        if step >= 2500:
            trained["actor/late"] = 0.25
        out += [Metric("trainer", "trainer", name, value, step - 1, {}, at + 500) for name, value in trained.items()]
    return out


def test_window_bounds_memory_and_the_files_are_the_whole_runs(tmp_path):
    window = 64
    table, expected = MetricTable(tmp_path, window_steps=window), Unbounded()
    most_rows = most_wide = 0
    for step in range(5000):
        batch = _step(step)
        if step % 1000 == 999:  # a rollback: the trainer re-trains its last 20 steps, new values
            batch += [m for s in range(step - 20, step) for m in _step(s, trainer_shift=0.5) if m.role == "trainer"]
        if step % 700 == 0:
            batch += _step(max(step - 3, 0))  # a redelivery: duplicates, no change
        for metric in batch:
            table.add(metric)
            expected.add(metric)
        if step % 10 == 9:
            table.flush()
            most_rows, most_wide = max(most_rows, len(table.rows)), max(most_wide, len(table.wide))
        if step % 1000 == 999:
            assert _text(tmp_path / "metrics.csv") == expected.long_text()
            assert _text(tmp_path / "steps.csv") == expected.wide_text()
    table.flush()
    assert _text(tmp_path / "metrics.csv") == expected.long_text()
    assert _text(tmp_path / "steps.csv") == expected.wide_text()
    # a count, not RSS: the rows of each role's last `window` steps (plus the 10 steps of one flush) and the
    # steps.csv rows of the last `window` steps, against the run's 5,000 steps
    per_step = 3 + 2 + 5 + 1  # explorer, workers, trainer (with the late column), an eval at most
    assert len(expected.rows) > 45_000
    assert most_rows <= (window + 10) * per_step
    assert most_wide <= window + 10 and len(table.wide) <= window
    assert set(table.wide) == set(range(5000 - window, 5000))
    assert len(table._file.rows) == 0  # nothing read back from the file: all changes were in the window
    # what memory keeps whole is small: one latest row per series, the eval values
    assert len(table.latest) == 3 + 2 + 5 + 1 and len(table.evals) == 50


def test_a_changed_value_older_than_the_window_is_rewritten_from_the_file(tmp_path):
    table, expected = MetricTable(tmp_path, window_steps=4), Unbounded()
    for step in range(60):
        for metric in _step(step):
            table.add(metric)
            expected.add(metric)
        table.flush()
    assert ("explorer", "rollout/reward_mean", 3) not in table.rows  # let go of
    old = Metric("explorer", "explorer", "rollout/reward_mean", 0.75, 3, {}, T0 + 99)
    again = Metric("trainer", "trainer", "actor/kl", 1e-3, 3, {}, T0 + 5)  # what the file holds already
    unseen = Metric("explorer", "explorer", "rollout/unseen", 1.0, 3, {}, T0 + 6)  # new key, old step
    assert table.add(again) is None
    assert table.add(old) is not None and table.add(unseen) is not None
    assert table.add(old) is None  # the same value again: a duplicate of the pending change
    for metric in (old, unseen):
        expected.add(metric)
    table.flush()
    assert _text(tmp_path / "metrics.csv") == expected.long_text()
    assert _text(tmp_path / "steps.csv") == expected.wide_text()
    assert [r for r in csv.DictReader(open(tmp_path / "steps.csv")) if r["step"] == "3"][0][
        "rollout/reward_mean"] == "0.75"
    # once written and let go of, both are duplicates again (read from the file)
    assert table.add(old) is None and table.add(unseen) is None
    assert len(table.rows) <= 6 * 12 and len(table.wide) <= 4


def test_a_restart_loads_only_the_window_of_a_large_file(tmp_path, monkeypatch):
    table, expected = MetricTable(tmp_path, window_steps=512), Unbounded()
    for step in range(3000):
        for metric in _step(step):
            table.add(metric)
            expected.add(metric)
        if step % 50 == 49:
            table.flush()
    table.flush()
    (tmp_path / "steps.csv").unlink()  # a crash before steps.csv was written: the restart rebuilds it

    held = []  # rows in memory at each eviction while loading: the window and the rows read since the last one
    evict = MetricTable._evict
    monkeypatch.setattr(metric_table, "LOAD_EVICT_EVERY", 100)
    monkeypatch.setattr(MetricTable, "_evict", lambda self: (held.append(len(self.rows)), evict(self)))
    reloaded = MetricTable(tmp_path, window_steps=16)
    assert len(held) > 250 and max(held) <= 16 * 11 + 100
    monkeypatch.undo()
    assert 0 < len(reloaded.rows) <= 16 * 11 and len(reloaded.wide) == 0  # steps.csv's rows come at the flush
    assert {row.step for row in reloaded.rows.values() if row.role == "explorer"} == set(range(3000 - 16, 3000))
    assert len(reloaded.evals) == 30  # every eval value, for the eval table
    eval_latest = reloaded.latest[("eval/x/mean@4", "explorer", "explorer")]
    assert eval_latest.step == 2900  # out of the window, still the gauge's value at the restart
    for metric in _step(2990) + _step(10):  # redelivered, inside and outside the window: nothing new
        assert reloaded.add(metric) is None
    reloaded.flush()
    assert _text(tmp_path / "metrics.csv") == expected.long_text()
    assert _text(tmp_path / "steps.csv") == expected.wide_text()
    assert set(reloaded.wide) == set(range(2999 - 15, 3000))
    for metric in _step(3000):
        assert reloaded.add(metric) is not None
        expected.add(metric)
    reloaded.flush()
    assert _text(tmp_path / "metrics.csv") == expected.long_text()
    assert _text(tmp_path / "steps.csv") == expected.wide_text()


@pytest.mark.parametrize("late", [False, True])
def test_steps_csv_appends_new_steps_and_rewrites_only_the_changed_tail(tmp_path, late):
    """New steps are appended and a trainer value fills in the last row in place; only a new column or a step
    before the window rebuilds the file (a new inode)."""
    table, expected = MetricTable(tmp_path, window_steps=8), Unbounded()
    for step in range(30):
        for metric in _step(step):
            table.add(metric)
            expected.add(metric)
        table.flush()
    inode = (tmp_path / "steps.csv").stat().st_ino
    for metric in _step(30):
        table.add(metric)
        expected.add(metric)
    table.flush()
    assert (tmp_path / "steps.csv").stat().st_ino == inode  # in place
    change = (Metric("trainer", "trainer", "actor/kl", 0.5, 2, {}, T0) if late  # before the window
              else Metric("trainer", "trainer", "actor/kl", 0.5, 27, {}, T0))
    table.add(change)
    expected.add(change)
    table.flush()
    assert ((tmp_path / "steps.csv").stat().st_ino != inode) == late
    assert _text(tmp_path / "steps.csv") == expected.wide_text()
    assert _text(tmp_path / "metrics.csv") == expected.long_text()
