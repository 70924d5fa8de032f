"""The monitor's wide form, ``steps.csv``: one row per step (in step order) with the explorer's ``rollout/*``,
``time/*`` and ``eval/*`` values and the trainer's ``actor/*``, ``trainer/*`` (and other algorithms') values.

Memory holds the rows of the last ``window_steps`` steps and where each starts in the file. A flush appends the
rows of new steps, or rewrites the file from the first changed row of the window on (the trainer's values of a
step come after the explorer's): both in place, one write. The whole file is rebuilt, from ``metrics.csv`` and
renamed over it, only when its columns change, a step older than the window changes, or at a (re)start. The
rebuild sorts the long rows by step in a temporary SQLite database, so it needs no memory per step either.
"""
from __future__ import annotations

import csv
import io
import os
import sqlite3
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import closing
from itertools import groupby
from pathlib import Path

STEPS_CSV = "steps.csv"
# Which metrics become columns of steps.csv: role -> name prefixes.
STEP_COLUMNS: dict[str, tuple[str, ...]] = {"explorer": ("rollout/", "time/", "eval/"),
                                             "trainer": ("actor/", "trainer/", "sft/", "dpo/", "mix/",
                                                         "distill/")}


def step_column(row) -> str | None:
    """The steps.csv column of a row, or None when the wide form does not carry it."""
    prefixes = STEP_COLUMNS.get(row.role, ())
    return row.name if row.name.startswith(prefixes) else None


def column_order(names) -> list[str]:
    """The explorer's columns, then the trainer's, each by name."""
    order = {role: i for i, role in enumerate(STEP_COLUMNS)}

    def rank(name: str) -> tuple[int, str]:
        role = next(r for r, prefixes in STEP_COLUMNS.items() if name.startswith(prefixes))
        return order[role], name

    return sorted(names, key=rank)


class StepsTable:
    """steps.csv and the window of its rows in memory (module docstring)."""

    def __init__(self, path: Path, long_rows: Callable[[], Iterable], window_steps: int):
        """``long_rows``: the rows of metrics.csv, read anew at each call (what a rebuild reads)."""
        self.path = path
        self.long_rows = long_rows
        self.window_steps = window_steps
        self.wide: dict[int, dict[str, float]] = {}  # the window's rows, written or not
        self.stale = False  # rebuild at the next flush
        self._dirty: set[int] = set()
        self._columns: list[str] | None = None  # the file's, once this table wrote it
        self._offsets: dict[int, int] = {}  # step -> where its row starts, for the window's rows in the file
        self._last: int | None = None  # the file's last step
        self._end = 0

    def put(self, row) -> None:
        column = step_column(row)
        if column is not None:
            self.wide.setdefault(row.step, {})[column] = row.value
            self._dirty.add(row.step)

    def flush(self) -> None:
        """Make steps.csv hold what ``metrics.csv`` holds (flushed first)."""
        if self.stale or (self._dirty and not self._rewrite_in_place()):
            self.rebuild()
        self._dirty.clear()
        self.stale = False
        if self.wide:
            floor = max(self.wide) - self.window_steps + 1
            for step in [step for step in self.wide if step < floor]:
                del self.wide[step]
                self._offsets.pop(step, None)

    def _rewrite_in_place(self) -> bool:
        """Append the new steps' rows, or rewrite from the first changed row of the window on; False when the
        change needs a rebuild (a new column, a step before the window)."""
        columns = self._columns
        if columns is None or not self.path.is_file():
            return False
        if any(name not in columns for step in self._dirty for name in self.wide[step]):
            return False
        first = min(self._dirty)
        if self._last is None or first > self._last:
            start, steps = self._end, sorted(self._dirty)
        else:
            if not self._offsets or first < min(self._offsets):
                return False
            start_step = min(step for step in self._offsets if step >= first)
            start, steps = self._offsets[start_step], sorted(step for step in self.wide if step >= start_step)
        data = io.BytesIO()
        for step in steps:
            self._offsets[step] = start + data.tell()
            data.write(self._line(step, self.wide[step]))
        with self.path.open("r+b") as f:
            f.seek(start)
            f.write(data.getvalue())
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        self._end = start + len(data.getvalue())
        self._last = steps[-1]
        return True

    def _line(self, step: int, values: dict[str, float]) -> bytes:
        text = io.StringIO()
        csv.writer(text).writerow([str(step)] + [repr(values[c]) if c in values else "" for c in self._columns])
        return text.getvalue().encode()

    def rebuild(self) -> None:
        """steps.csv from metrics.csv (the last value of a (step, column) in the file wins), renamed over the
        old one; memory then holds the file's last ``window_steps`` rows."""
        with closing(sqlite3.connect("")) as db:  # "": a private temporary database, spilled to disk
            db.execute("CREATE TABLE cell (step INTEGER, name TEXT, value TEXT, PRIMARY KEY (step, name))")
            with db:
                db.executemany("INSERT OR REPLACE INTO cell VALUES (?, ?, ?)",
                               ((row.step, column, repr(row.value)) for row in self.long_rows()
                                if (column := step_column(row)) is not None))
            self._columns = column_order(name for (name,) in db.execute("SELECT DISTINCT name FROM cell"))
            tail: deque[tuple[int, int, dict[str, float]]] = deque(maxlen=self.window_steps)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("wb") as f:
                f.write(self._header())
                cells = db.execute("SELECT step, name, value FROM cell ORDER BY step")
                for step, group in groupby(cells, key=lambda cell: cell[0]):
                    values = {name: float(value) for _, name, value in group}
                    tail.append((step, f.tell(), values))
                    f.write(self._line(step, values))
                self._end = f.tell()
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        self._last = tail[-1][0] if tail else None
        floor = self._last - self.window_steps + 1 if tail else 0
        self.wide = {step: values for step, _, values in tail if step >= floor}
        self._offsets = {step: offset for step, offset, _ in tail if step >= floor}

    def _header(self) -> bytes:
        text = io.StringIO()
        csv.writer(text).writerow(["step", *self._columns])
        return text.getvalue().encode()
