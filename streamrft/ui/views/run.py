"""The run's steps and eval table, as the monitor wrote them."""
from __future__ import annotations

from pathlib import Path

from ..html import join, num, page, table, tag
from ..run_files import Table, read_steps, short_number, split


def run_page(steps_csv: Path | None) -> str:
    table_ = read_steps(steps_csv) if steps_csv is not None else None
    if table_ is None:
        where = steps_csv or "the run's output directory"
        body = tag("p", f"no steps yet: {where} is written by `streamrft monitor` (part of `streamrft run`)",
                   class_="empty")
        return page("Run", "/run", body)
    steps, evals = split(table_)
    body = join([tag("p", f"from {steps_csv}", class_="muted"),
                 tag("h2", "Evals"), _table(evals, "no evals yet"),
                 tag("h2", "Steps"), _table(steps, "no steps yet")])
    return page("Run", "/run", body)


def _table(t: Table, empty: str):
    return table(t.columns, ([num(short_number(v)) for v in row] for row in t.rows), empty=empty)
