"""The web UI's pieces that need no broker: escaping, the lag chart, the lag history's bound, the run tables, the
option checks, and the read-only rule on a real HTTP stack (FastAPI's test client over a cluster view that is
never reached)."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamrft.errors import ConfigError
from streamrft.kafka.inspection import GroupState, PartitionLag
from streamrft.ui.html import esc, link, table, tag
from streamrft.ui.lag_history import LagHistory
from streamrft.ui.run_files import read_steps, short_number, split
from streamrft.ui.settings import settings_from
from streamrft.ui.svg import line_chart
from streamrft.ui.views.run import run_page


def test_values_are_escaped_markup_is_not():
    cell = table(["k"], [["<b>x</b>"], [tag("b", "<i>")]])
    assert "&lt;b&gt;x&lt;/b&gt;" in cell and "<b>&lt;i&gt;</b>" in cell
    assert esc('"q"') == "&quot;q&quot;"
    assert link("/records", "r", topic="a&b", key="<k>") == '<a href="/records?topic=a%26b&amp;key=%3Ck%3E">r</a>'
    assert tag("option", "x", value="1", selected=None) == '<option value="1">x</option>'


def test_lag_chart_and_bounded_history():
    history = LagHistory(keep=3)
    for at, lag in enumerate([4, 3, 7, 1]):
        history.add([GroupState("run.explorer", "STABLE", (PartitionLag("t", 0, 10 - lag, 10, lag),))], float(at))
    line = history.of("run.explorer")["t"]
    assert line == [(1.0, 3.0), (2.0, 7.0), (3.0, 1.0)]  # oldest sample dropped
    svg = line_chart({"tasks</text>": line})
    assert svg.startswith("<svg") and "<polyline" in svg and "tasks&lt;/text&gt;: 1" in svg
    assert "no samples" in line_chart({})


def test_run_tables(tmp_path: Path):
    assert "no steps yet" in run_page(tmp_path / "steps.csv")
    (tmp_path / "steps.csv").write_text("step,rollout/accuracy,eval/a/mean@4,actor/kl\n0,0.5,,0.1\n1,0.75,0.25,\n")
    steps, evals = split(read_steps(tmp_path / "steps.csv"))
    assert steps.columns == ["step", "rollout/accuracy", "actor/kl"] and steps.rows[1] == ["1", "0.75", ""]
    assert evals.columns == ["step", "eval/a/mean@4"] and evals.rows == [["1", "0.25"]]
    assert short_number("0.123456789") == "0.1235" and short_number("3.0") == "3" and short_number("x") == "x"


def test_options_are_checked_with_the_option_named():
    assert settings_from(port=None).host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"--port = 70000"):
        settings_from(port=70000)
    with pytest.raises(ConfigError, match=r"--sample-s"):
        settings_from(sample_s=0)


def test_every_method_but_get_is_refused():
    from fastapi.testclient import TestClient

    from streamrft.ui.app import UiState, create_app

    class Unreached:  # the refusal comes before any page asks the cluster
        def __getattr__(self, name):
            raise AssertionError(f"the cluster was asked for {name}")

    client = TestClient(create_app(UiState(Unreached(), LagHistory(2), settings_from(), None)))
    for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
        response = client.request(method, "/records?topic=x")
        assert response.status_code == 405 and response.headers["allow"] == "GET, HEAD"
    assert client.get("/healthz").text == "ok\n"
    assert "no steps yet" in client.get("/run").text
