"""The monitor's wide table of a run (``steps.csv``: one row per step), split into the training columns and
the eval table (the ``eval/*`` columns, on the steps that have an eval)."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

EVAL_PREFIX = "eval/"


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[str]]


def read_steps(path: Path) -> Table | None:
    """The table in ``path``, None while the monitor has not written it. The monitor renames a rebuilt file
    over it and otherwise rewrites only its last rows in place, in one write: a read racing that write may see
    the last rows cut (short rows read as empty cells) until the next read."""
    if not path.is_file():
        return None
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    if not lines:
        return None
    return Table(lines[0], [line for line in lines[1:] if line])


def split(table: Table) -> tuple[Table, Table]:
    """(the step column with every non-eval column, the step column with the eval columns on rows with one)."""
    evals = [i for i, name in enumerate(table.columns) if name.startswith(EVAL_PREFIX)]
    others = [i for i in range(len(table.columns)) if i not in evals]

    def pick(indices: list[int], row: list[str]) -> list[str]:
        return [row[i] if i < len(row) else "" for i in indices]

    steps = Table(pick(others, table.columns), [pick(others, row) for row in table.rows])
    first = [0] + evals
    eval_rows = [pick(first, row) for row in table.rows if any(v for v in pick(evals, row))]
    return steps, Table(pick(first, table.columns), eval_rows)


def short_number(text: str) -> str:
    """``0.123456789`` -> ``0.1235``: the tables are for reading; the CSV keeps every digit."""
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
