"""The monitor's de-duplicated metrics (one value per ``(source, name, step)``, last delivery wins) and their
long-form file, ``metrics.csv``: step, role, source, name, value, created_at. No Kafka in here.

A run lasts days, so memory holds only a window: each role's last ``WINDOW_STEPS`` steps (a rollback re-trains
steps within the last few checkpoints, so older values are final in practice), the latest value of each series
(for Prometheus at a restart) and the eval values (the eval table, sent whole to the trackers). The file holds
everything: it grows by appending and is rewritten, streaming from itself, only when a value it holds changes
or it had a torn last line. A record for a step older than the window is checked against the file.
"""
from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from sys import intern  # a few names, repeated in every row held

from streamrft.schemas import Metric

from .steps_table import STEPS_CSV, StepsTable, step_column

logger = logging.getLogger(__name__)

METRICS_CSV = "metrics.csv"
LONG_COLUMNS = ("step", "role", "source", "name", "value", "created_at")
# Steps of each role kept in memory; a value for an older step is looked up in metrics.csv.
WINDOW_STEPS = 512
LOAD_EVICT_EVERY = 2_000  # rows read between two evictions while loading
EVAL_PREFIX = "eval/"

Key = tuple[str, str, int]  # (source, name, step)


@dataclass(frozen=True, slots=True)
class Row:
    """One metric value as the CSV holds it."""

    step: int
    role: str
    source: str
    name: str
    value: float
    created_at: int

    @property
    def key(self) -> Key:
        return self.source, self.name, self.step

    @property
    def series(self) -> tuple[str, str, str]:
        """What a Prometheus gauge shows one value of: (name, role, source)."""
        return self.name, self.role, self.source

    @classmethod
    def of(cls, metric: Metric) -> "Row":
        return cls(metric.step, intern(metric.role), intern(metric.source), intern(metric.name), float(metric.value),
                   int(metric.created_at))

    def as_csv(self) -> list[str]:
        return [str(self.step), self.role, self.source, self.name, repr(self.value), str(self.created_at)]

    @classmethod
    def from_csv(cls, fields: dict[str, str]) -> "Row":
        return cls(int(fields["step"]), intern(fields["role"]), intern(fields["source"]), intern(fields["name"]),
                   float(fields["value"]), int(fields["created_at"]))


def read_rows(path: Path, warn: bool = False) -> Iterator[Row | None]:
    """The rows of a metrics.csv, streaming, in file order; None for a line that is no row (a torn last line)."""
    if not path.is_file():
        return
    with path.open(newline="") as f:
        for line, fields in enumerate(csv.DictReader(f), start=2):
            try:
                yield Row.from_csv(fields)
            except (KeyError, TypeError, ValueError):
                if warn:
                    logger.warning("%s:%d: unreadable row dropped (%r); the file will be rewritten", path, line,
                                   fields)
                yield None


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class FileBlock:
    """The rows of metrics.csv for one range of steps, read from the file when a record comes for a step that
    memory no longer holds; a replay of old records reads the file once per range, not once per record."""

    def __init__(self, path: Path, span: int):
        self.path = path
        self.span = span
        self.rows: dict[Key, Row] = {}
        self.steps = range(0)

    def get(self, key: Key) -> Row | None:
        step = key[2]
        if step not in self.steps:
            self.steps = range(step, step + self.span)
            self.rows = {row.key: row for row in read_rows(self.path) if row is not None and row.step in self.steps}
        return self.rows.get(key)

    def put(self, row: Row) -> None:
        """A row memory lets go of (the file holds it): what the block read before it was flushed lacks it."""
        if row.step in self.steps:
            self.rows[row.key] = row


class MetricTable:
    """The run's metrics: the recent window in memory (``rows``), everything in ``metrics.csv``, and the wide
    form in ``steps.csv`` (:class:`StepsTable`)."""

    def __init__(self, directory: Path, window_steps: int = WINDOW_STEPS):
        self.directory = directory
        self.long_path = directory / METRICS_CSV
        self.window_steps = window_steps
        self.rows: dict[Key, Row] = {}
        self.latest: dict[tuple[str, str, str], Row] = {}  # per series: the row of its highest step
        self.evals: dict[Key, Row] = {}
        self.steps = StepsTable(directory / STEPS_CSV, self._file_rows, window_steps)
        self._file = FileBlock(self.long_path, window_steps)
        self._top: dict[str, int] = {}  # role -> its highest step
        self._keys_at: dict[str, dict[int, set[Key]]] = {}  # role -> step -> keys of `rows`
        self._evicted_through: dict[str, int] = {}  # source -> highest step of its rows memory let go of
        self._appended: dict[Key, Row] = {}  # new rows, not in the file yet
        self._changed: dict[Key, Row] = {}  # rows the file holds with another value
        self._rewrite = False
        self._load()

    @property
    def wide(self) -> dict[int, dict[str, float]]:
        """The steps.csv rows in memory (the window)."""
        return self.steps.wide

    def _file_rows(self) -> Iterator[Row]:
        return (row for row in read_rows(self.long_path) if row is not None)

    def _floor(self, role: str) -> int:
        return self._top[role] - self.window_steps + 1

    def _load(self) -> None:
        """One streaming pass over metrics.csv, letting go of what falls out of the window as it reads (the
        file is in delivery order, near step order), and of the rest at the end."""
        if not self.long_path.is_file():
            return
        count, wide = 0, False
        for row in read_rows(self.long_path, warn=True):
            if row is None:
                self._rewrite = True
                continue
            count += 1
            wide = wide or step_column(row) is not None
            self._top[row.role] = max(self._top.get(row.role, row.step), row.step)
            self._hold(row)
            self._note(row)
            if count % LOAD_EVICT_EVERY == 0:
                self._evict()
        self._evict()
        self.steps.stale = wide or not self.steps.path.is_file()
        logger.info("monitor: %d metric value(s) in %s, %d of them in memory", count, self.long_path, len(self.rows))

    def _note(self, row: Row) -> None:
        latest = self.latest.get(row.series)
        if latest is None or row.step >= latest.step:
            self.latest[row.series] = row
        if row.name.startswith(EVAL_PREFIX):
            self.evals[row.key] = row

    def _hold(self, row: Row) -> None:
        self.rows[row.key] = row
        self._keys_at.setdefault(row.role, {}).setdefault(row.step, set()).add(row.key)

    def _let_go(self, source: str, step: int) -> None:
        self._evicted_through[source] = max(self._evicted_through.get(source, step), step)

    def add(self, metric: Metric) -> Row | None:
        """Record a delivered metric. Returns its row when it is new or its value changed (keep last), None
        for a duplicate of what the table already holds."""
        row = Row.of(metric)
        old = self.rows.get(row.key)
        through = self._evicted_through.get(row.source)
        if old is None and through is not None and row.step <= through:
            old = self._file.get(row.key)
        if old is not None and _same(old.value, row.value) and old.role == row.role:
            return None
        if old is None or row.key in self._appended:
            self._appended[row.key] = row
        else:
            self._changed[row.key] = row
        self._top[row.role] = max(self._top.get(row.role, row.step), row.step)
        self._hold(row)
        self._note(row)
        self.steps.put(row)
        return row

    def flush(self) -> None:
        """Make the files hold everything added so far (called before offsets are committed), then let go of
        the rows that fell out of the window."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._rewrite or self._changed:
            self._rewrite_long()
        elif self._appended:
            new_file = not self.long_path.is_file() or self.long_path.stat().st_size == 0
            with self.long_path.open("a", newline="") as f:
                writer = csv.writer(f)
                if new_file:
                    writer.writerow(LONG_COLUMNS)
                writer.writerows(row.as_csv() for row in self._appended.values())
                f.flush()
                os.fsync(f.fileno())
        self._appended.clear()
        self._changed.clear()
        self._rewrite = False
        self.steps.flush()
        self._evict()

    def _rewrite_long(self) -> None:
        """metrics.csv from itself: its rows in their order with the changed values, then the new rows."""
        changed = self._changed

        def rows() -> Iterable[list[str]]:
            written = set()
            for row in read_rows(self.long_path):
                if row is not None:
                    if row.key in changed:
                        written.add(row.key)
                    yield changed.get(row.key, row).as_csv()
            yield from (row.as_csv() for key, row in changed.items() if key not in written)
            yield from (row.as_csv() for row in self._appended.values())

        atomic_csv(self.long_path, LONG_COLUMNS, rows())

    def _evict(self) -> None:
        for role, keys_at in self._keys_at.items():
            floor = self._floor(role)
            for step in [step for step in keys_at if step < floor]:
                for key in keys_at.pop(step):
                    row = self.rows.get(key)
                    if row is not None and row.role == role:  # a key whose source changed role is held by both
                        del self.rows[key]
                        self._file.put(row)
                        self._let_go(row.source, step)


def atomic_csv(path: Path, header, rows: Iterable[list[str]]) -> None:
    """Write ``path`` whole, as a new file renamed over it: a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
