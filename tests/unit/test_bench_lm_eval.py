"""`streamrft bench --lm-eval`'s parts that need no server: lm-eval's results as bench columns, its arguments,
and the CSV with a version's columns on each of its rows (on the broker: tests/integration/test_bench_lm_eval.py)."""
from __future__ import annotations

import argparse
import csv
import sys

import pytest

from streamrft.commands.bench import _limit
from streamrft.config import EvalTaskset
from streamrft.consumers.bench import BenchRow, bench_config, write_outputs
from streamrft.consumers.bench_lm_eval import check_tasks, lm_eval_config, parse_model_args, task_metrics
from streamrft.errors import ConfigError


def test_task_metrics_are_the_asked_tasks_and_groups_numeric_figures():
    results = {  # the shape of lm-eval 0.4's simple_evaluate
        "results": {
            "arith": {"alias": "arith", "acc,none": 0.5, "acc_stderr,none": 0.25},
            "gsm": {"alias": "gsm", "exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": "N/A"},
            "mmlu_algebra": {"alias": " - algebra", "acc,none": 0.75},
            "flag": {"acc,none": True},
        },
        "groups": {"mmlu": {"alias": "mmlu", "acc,none": 0.375, "acc_stderr,none": 0.0625}},
        "group_subtasks": {"mmlu": ["mmlu_algebra"], "arith": [], "gsm": []},
        "configs": {"arith": {"num_fewshot": 0}},
    }
    assert task_metrics(results) == {
        "lm_eval/arith/acc": 0.5, "lm_eval/arith/acc_stderr": 0.25,
        "lm_eval/gsm/exact_match,strict-match": 0.125,  # its stderr could not be computed: no column
        "lm_eval/mmlu/acc": 0.375, "lm_eval/mmlu/acc_stderr": 0.0625,  # the group, not its subtasks
    }
    assert task_metrics({"results": {}}) == {}


def test_model_args_may_not_point_lm_eval_elsewhere():
    pytest.importorskip("lm_eval")
    assert parse_model_args(None) == {}
    assert parse_model_args("num_concurrent=8,batch_size=4") == {"num_concurrent": 8, "batch_size": 4}
    with pytest.raises(ConfigError, match="base_url is set by the bench"):
        parse_model_args("base_url=http://elsewhere/v1/completions")


def test_an_include_path_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--lm-eval-include .*no such file"):
        check_tasks(["arith"], tmp_path / "missing")


def test_limit_is_a_count_or_a_share():
    assert _limit("5") == 5 and isinstance(_limit("5"), int)
    assert _limit("0.25") == 0.25
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            _limit(bad)


def test_lm_eval_namespace_is_its_own_and_its_server_is_loopback_behind_a_key(tmp_path):
    from streamrft.config import load_config

    config = load_config(overrides={"name": "run", "serve": {"host": "0.0.0.0", "api_key": "theirs", "port": 8000}},
                         env={})
    served = lm_eval_config(config, "ours", weights_url="file:///tmp/store")
    assert served.name == "run-lm-eval"
    assert len({served.topic("sync"), config.topic("sync"), bench_config(config).topic("sync")}) == 3
    assert (served.serve.host, served.serve.port, served.serve.api_key.get_secret_value()) == ("127.0.0.1", 0, "ours")
    assert served.serve.max_pending == 1 and served.weights_url == "file:///tmp/store"
    assert config.serve.host == "0.0.0.0"  # the run's own settings are untouched


def test_the_csv_has_a_versions_columns_on_each_of_its_rows(tmp_path):
    tasksets = [EvalTaskset(name="a", path="a.jsonl", repeat_times=2), EvalTaskset(name="b", path="b.jsonl",
                                                                                  repeat_times=2)]
    rows = [BenchRow(v, t.name, {f"eval/{t.name}/mean@2": v / 10}) for v in (0, 1) for t in tasksets]
    table, _ = write_outputs(rows, tasksets, tmp_path, {0: {"lm_eval/arith/acc": 0.5},
                                                        1: {"lm_eval/arith/acc": 0.75}})
    with table.open() as f:
        read = list(csv.DictReader(f))
    assert [(r["version"], r["taskset"], r["mean@2"], r["lm_eval/arith/acc"]) for r in read] == [
        ("0", "a", "0.0", "0.5"), ("0", "b", "0.0", "0.5"), ("1", "a", "0.1", "0.75"), ("1", "b", "0.1", "0.75")]
    table, _ = write_outputs(rows, tasksets, tmp_path)  # without lm-eval: the columns it always had
    assert table.read_text().splitlines()[0] == "version,taskset,mean@2"


def test_without_lm_eval_the_error_says_how_to_install_it(monkeypatch):
    from streamrft.consumers.bench_lm_eval import LmEvalPlan

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"lm_eval is missing\): pip install 'lm-eval\[api\]'"):
        LmEvalPlan.of(["arith"])
