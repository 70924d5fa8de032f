"""Reading task files (JSONL, JSON array, CSV, Parquet, or stdin) into Task records.

Every row either becomes a Task or a Rejected entry with its line number, the reason and the row as read, so
nothing is dropped silently and :func:`write_rejects` can hand every rejected row back to be fixed. Line numbers are 1-based lines for JSONL/CSV (the header is line 1) and 1-based row/element indices for
JSON arrays and Parquet.
"""
from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from streamrft.schemas import Task


@dataclass(frozen=True)
class FieldMapping:
    """Which source fields become the task's question, answer and id, and the task's fixed settings."""

    prompt_key: str = "question"
    answer_key: str | None = "answer"  # None: tasks without a reference answer
    id_key: str | None = None  # None: ids are <taskset>-<line>
    workflow: str = "arithmetic"
    taskset: str = "default"
    reward_fn: str | None = None
    repeat_times: int | None = None

    @classmethod
    def from_task_file(cls, task_file) -> "FieldMapping":
        """The mapping a config ``TaskFile`` (or ``EvalTaskset``) describes."""
        taskset = task_file.taskset or getattr(task_file, "name", None) or Path(task_file.path).stem
        return cls(prompt_key=task_file.prompt_key, answer_key=task_file.answer_key, workflow=task_file.workflow,
                   taskset=taskset)


@dataclass(frozen=True)
class Rejected:
    line: int
    reason: str
    # the row as read (an object, a CSV row's cells, or the text of a line that is not JSON), so it can be fixed
    # and produced again; not part of equality, which is about what was rejected and why
    row: Any = field(default=None, compare=False)


def read_rows(source: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, raw row) pairs from a file path or ``-`` (stdin, JSONL or a JSON array)."""
    if str(source) == "-":
        yield from _json_text_rows(sys.stdin.read())
        return
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path)
    elif suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            yield from _csv_rows(handle)
    elif suffix in (".json", ".jsonl", ".ndjson"):
        yield from _json_text_rows(path.read_text(encoding="utf-8"))
    else:
        raise ValueError(f"{path}: unknown task file type {suffix!r}; use .jsonl, .json, .csv or .parquet")


def _json_text_rows(text: str) -> Iterator[tuple[int, Any]]:
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"JSON array does not parse at line {exc.lineno}: {exc.msg}") from exc
        yield from enumerate(rows, start=1)
        return
    for number, line in enumerate(io.StringIO(text), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, Rejected(number, f"not valid JSON: {exc.msg} (column {exc.colno})", line.rstrip("\r\n"))


EXTRA_CELLS = "_extra_cells"  # where a rejected CSV row keeps the cells beyond the header's columns


def _csv_rows(handle) -> Iterator[tuple[int, Any]]:
    reader = csv.DictReader(handle)
    for row in reader:
        if None in row:  # more cells than header columns
            cells = {key: value for key, value in row.items() if key is not None} | {EXTRA_CELLS: row[None]}
            yield reader.line_num, Rejected(reader.line_num, f"{len(row[None])} more cell(s) than header columns",
                                            cells)
        else:
            yield reader.line_num, row


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError("reading Parquet needs pyarrow: pip install 'streamrft[parquet]'") from exc
    number = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            number += 1
            yield number, row


def to_task(number: int, row: Any, mapping: FieldMapping) -> Task | Rejected:
    """One row -> a Task, or the reason it cannot be one (with the row)."""
    if isinstance(row, Rejected):
        return row
    outcome = _task_or_reason(number, row, mapping)
    return Rejected(number, outcome, row) if isinstance(outcome, str) else outcome


def _task_or_reason(number: int, row: Any, mapping: FieldMapping) -> Task | str:
    """The Task, or the reason (a sentence that says how to fix it) the row cannot be one."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, expected an object with a {mapping.prompt_key!r} field"
    prompt = row.get(mapping.prompt_key)
    if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
        return f"missing or empty {mapping.prompt_key!r} (set --prompt-key to the field that holds the prompt)"
    payload = {k: v for k, v in row.items() if k not in (mapping.prompt_key, mapping.answer_key, mapping.id_key)}
    payload["question"] = prompt
    if mapping.answer_key is not None:
        answer = row.get(mapping.answer_key)
        if answer is None or answer == "":
            return f"missing {mapping.answer_key!r} (set --answer-key, or --no-answer for tasks without one)"
        payload["answer"] = answer
    task_id = f"{mapping.taskset}-{number}"
    if mapping.id_key is not None:
        if row.get(mapping.id_key) in (None, ""):
            return f"missing id field {mapping.id_key!r}"
        task_id = str(row[mapping.id_key])
    try:
        encoded = json.dumps(payload, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        return f"payload is not JSON-serialisable: {exc}"
    return Task(task_id=task_id, taskset=mapping.taskset, workflow=mapping.workflow, payload=encoded,
                reward_fn=mapping.reward_fn, repeat_times=mapping.repeat_times)


def read_tasks(source: str | Path, mapping: FieldMapping) -> Iterator[Task | Rejected]:
    for number, row in read_rows(source):
        yield to_task(number, row, mapping)


def write_rejects(path: str | Path, rejected: Iterable[Rejected]) -> int:
    """Write every rejected row to ``path`` as JSONL, one ``{"line", "reason", "row"}`` object per row, and
    return how many. Fix the rows and produce them again (``jq -c .row FILE`` gives them back as a task file).
    Values JSON cannot hold (a Parquet timestamp) are written as their text."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as handle:
        for item in rejected:
            record = {"line": item.line, "reason": item.reason, "row": item.row}
            handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            count += 1
    return count


def count_rows(source: str | Path) -> int | None:
    """Rows in a file for the progress bar (None when unknown, e.g. stdin)."""
    if str(source) == "-":
        return None
    path = Path(source)
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return None
        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix.lower() == ".json":
        return None
    with path.open("rb") as handle:
        lines = sum(1 for line in handle if line.strip())
    return lines - 1 if path.suffix.lower() == ".csv" else lines
