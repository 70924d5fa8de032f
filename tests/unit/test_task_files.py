"""Task files -> Task records: every format, key mapping, and rejected rows with line numbers and reasons."""
from __future__ import annotations

import json

import pytest

from streamrft.producers.task_files import EXTRA_CELLS, FieldMapping, Rejected, count_rows, read_tasks, write_rejects


def _split(items):
    tasks = [i for i in items if not isinstance(i, Rejected)]
    rejected = [i for i in items if isinstance(i, Rejected)]
    return tasks, rejected


def test_jsonl_with_bad_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "1+1", "answer": 2}\n'
                    'not json\n'
                    '\n'
                    '{"answer": 3}\n'
                    '[1, 2]\n'
                    '{"question": "2+2", "answer": 4, "level": "easy"}\n')
    tasks, rejected = _split(list(read_tasks(path, FieldMapping(taskset="t"))))
    assert [t.task_id for t in tasks] == ["t-1", "t-6"]
    assert json.loads(tasks[1].payload) == {"question": "2+2", "answer": 4, "level": "easy"}
    assert [(r.line, r.reason.split(":")[0].split(" (")[0]) for r in rejected] == [
        (2, "not valid JSON"), (4, "missing or empty 'question'"), (5, "row is a list, expected an object with a 'question' field")]
    assert count_rows(path) == 5


def test_json_array_and_key_mapping(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"id": "a", "prompt": "p1", "solution": "s1"}, {"id": "", "prompt": "p2", "solution": "s2"}]))
    mapping = FieldMapping(prompt_key="prompt", answer_key="solution", id_key="id", workflow="math_boxed",
                           taskset="ts", repeat_times=3)
    tasks, rejected = _split(list(read_tasks(path, mapping)))
    assert len(tasks) == 1 and tasks[0].task_id == "a" and tasks[0].workflow == "math_boxed"
    assert tasks[0].repeat_times == 3 and json.loads(tasks[0].payload) == {"question": "p1", "answer": "s1"}
    assert rejected == [Rejected(2, "missing id field 'id'")]


def test_csv_reports_file_lines(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("question,answer\n1+1,2\n,3\n2+2,4,extra\n3+3,6\n")
    tasks, rejected = _split(list(read_tasks(path, FieldMapping(taskset="c"))))
    assert [t.task_id for t in tasks] == ["c-2", "c-5"]
    assert [r.line for r in rejected] == [3, 4]
    assert count_rows(path) == 4


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["1+1", None], "answer": [2, 3]}), path)
    tasks, rejected = _split(list(read_tasks(path, FieldMapping(taskset="p"))))
    assert len(tasks) == 1 and [r.line for r in rejected] == [2]
    assert count_rows(path) == 2


def test_no_answer_mode(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "guess"}\n')
    tasks, rejected = _split(list(read_tasks(path, FieldMapping(answer_key=None, workflow="guess_number"))))
    assert len(tasks) == 1 and not rejected


def test_unknown_suffix_is_an_error(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="unknown task file type"):
        list(read_tasks(path, FieldMapping()))


def test_every_rejected_row_is_written_with_its_line_reason_and_row(tmp_path):
    """More bad rows than the command lists: the rejects file has every one, and its rows, fixed, become tasks."""
    path = tmp_path / "t.jsonl"
    lines, bad = [], {}
    for number in range(1, 61):
        if number % 3 == 0:
            lines.append(json.dumps({"question": f"{number}+1"}))  # no answer
            bad[number] = {"question": f"{number}+1"}
        elif number % 7 == 0:
            lines.append(f"{{oops {number}")
            bad[number] = f"{{oops {number}"
        else:
            lines.append(json.dumps({"question": f"{number}+1", "answer": number + 1}))
    path.write_text("\n".join(lines) + "\n")
    tasks, rejected = _split(list(read_tasks(path, FieldMapping(taskset="t"))))
    assert len(tasks) == 60 - len(bad) and len(bad) > 20
    rejects = tmp_path / "rejects.jsonl"
    assert write_rejects(rejects, rejected) == len(bad)
    records = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert {r["line"]: r["row"] for r in records} == bad
    assert all(r["reason"].startswith(("missing 'answer'", "not valid JSON")) for r in records)

    fixed = tmp_path / "fixed.jsonl"  # the user's fix: add the answers, drop the unreadable lines
    fixed.write_text("".join(json.dumps(r["row"] | {"answer": 0}) + "\n" for r in records if isinstance(r["row"], dict)))
    again, still_bad = _split(list(read_tasks(fixed, FieldMapping(taskset="t"))))
    assert len(again) == sum(isinstance(row, dict) for row in bad.values()) and not still_bad


def test_rejected_csv_and_parquet_rows_keep_their_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("question,answer\n,3\n2+2,4,extra\n")
    _, rejected = _split(list(read_tasks(path, FieldMapping(taskset="c"))))
    assert [r.row for r in rejected] == [{"question": "", "answer": "3"},
                                         {"question": "2+2", "answer": "4", EXTRA_CELLS: ["extra"]}]
    rejects = tmp_path / "r.jsonl"
    write_rejects(rejects, [Rejected(1, "payload is not JSON-serialisable", {"when": object()})])
    assert json.loads(rejects.read_text())["row"]["when"].startswith("<object object")  # written as text
