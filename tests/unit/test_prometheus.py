"""Prometheus: the scrape config ``streamrft monitor --prometheus-config`` writes, and the Grafana dashboard in
compose/ checked against the metric names the roles emit: the ones declared in streamrft/metric_catalog and the
ones the monitor exports from the metrics topic."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from streamrft.cli import main
from streamrft.config import load_config
from streamrft.metric_catalog import PROMETHEUS_METRICS

from .test_compose import _monitor_exported_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "streamrft.json"
METRIC_CLASSES = {"Counter": ("_total", "_created"), "Gauge": (),
                  "Histogram": ("_bucket", "_sum", "_count", "_created"), "Summary": ("_sum", "_count", "_created")}
# Prometheus' own series, present for every target
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def declared_metric_names() -> set[str]:
    """Every series name a role's own registry serves, from its declaration (streamrft/metric_catalog: no series
    is made without one), with the suffixes the client adds (a counter ``c`` is served as ``c_total``)."""
    return {name for m in PROMETHEUS_METRICS if not m.is_family
            for name in (m.name, *(m.name + suffix for suffix in METRIC_CLASSES[m.kind.title()]))}


def emitted_names() -> set[str]:
    return declared_metric_names() | _monitor_exported_names() | PROMETHEUS_SERIES


def unknown_metrics(dashboard: dict, emitted: set[str]) -> list[str]:
    """One line per panel query that names a metric nothing emits (or a name pattern that matches none)."""
    problems = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for pattern in re.findall(r'__name__=~"([^"]+)"', expr):
                if not any(re.fullmatch(pattern, name) for name in emitted):
                    problems.append(f"{panel['title']}: {pattern} matches no metric")
            bare = re.sub(r'"[^"]*"', '""', expr)  # label values are no metric names
            bare = re.sub(r"\[[^\]]*\]", "", bare)  # nor range durations
            for name in re.findall(r"\b(streamrft_[A-Za-z0-9_]+)", bare):
                if name not in emitted:
                    problems.append(f"{panel['title']}: no role emits {name}")
    return problems


def test_the_dashboard_names_only_metrics_the_roles_emit():
    dashboard = json.loads(DASHBOARD.read_text())
    emitted = emitted_names()
    assert {"streamrft_explorer_step", "streamrft_rollout_requests_total", "streamrft_trainer_step",
            "streamrft_dead_letters_total", "streamrft_monitor_records_total", "streamrft_role_restarts_total",
            "streamrft_role_up"} <= emitted
    assert unknown_metrics(dashboard, emitted) == []
    queried = {name for p in dashboard["panels"] for t in p.get("targets", [])
               for name in re.findall(r"\b(streamrft_[A-Za-z0-9_]+)", t["expr"])}
    assert queried & declared_metric_names(), "no panel shows a role's own metrics (lag, steps, requests)"


def test_a_panel_naming_a_metric_nobody_emits_fails():
    emitted = emitted_names()
    dashboard = {"panels": [
        {"title": "typo", "targets": [{"expr": 'rate(streamrft_rollout_request_total{status="OK"}[1m])'}]},
        {"title": "pattern", "targets": [{"expr": '{__name__=~"streamrft_evaluation_.+"}'}]},
        {"title": "fine", "targets": [{"expr": 'sum by (status) (rate(streamrft_rollout_requests_total[1m]))'}]}]}
    assert unknown_metrics(dashboard, emitted) == [
        "typo: no role emits streamrft_rollout_request_total", "pattern: streamrft_evaluation_.+ matches no metric"]


def test_prometheus_config_lists_each_role_on_its_configured_port(tmp_path, capsys):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({
        "name": "scrape", "metrics_host": "0.0.0.0",
        "explorer": {"metrics_port": 9201}, "trainer": {"metrics_port": 9203}, "monitor": {"metrics_port": 9200},
        "launch": {"rollout_workers": 3, "rollout_metrics_port_base": 9210, "metrics_port": 9204}}))
    out = tmp_path / "prometheus.yml"
    assert main(["monitor", str(config_file), "--prometheus-config", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in written["scrape_configs"]}
    assert targets == {"explorer": ["127.0.0.1:9201"], "trainer": ["127.0.0.1:9203"], "monitor": ["127.0.0.1:9200"],
                       "rollout": ["127.0.0.1:9210", "127.0.0.1:9211", "127.0.0.1:9212"],
                       "launch": ["127.0.0.1:9204"]}
    assert all(job["static_configs"][0]["labels"] == {"run": "scrape"} for job in written["scrape_configs"])
    assert written["global"]["scrape_interval"] == "5s"

    # the same role jobs as the compose stack's Prometheus (which has no `streamrft run`, so no launch job); a
    # role without a port, or a run without it, is left out
    compose = yaml.safe_load((ROOT / "compose" / "prometheus" / "prometheus.yml").read_text())
    assert set(targets) - {"launch"} == {job["job_name"] for job in compose["scrape_configs"]}
    config_file.write_text(yaml.safe_dump({"name": "explore", "mode": "explore", "explorer": {"metrics_port": None}}))
    assert main(["monitor", str(config_file), "--prometheus-config", "-"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {job["job_name"] for job in printed["scrape_configs"]} == {"monitor", "rollout", "launch"}


def test_prometheus_config_follows_the_default_ports():
    from streamrft.scrape_config import scrape_config

    config = load_config(overrides={"name": "d"}, env={})
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape_config(config)["scrape_configs"]}
    assert jobs["explorer"] == [f"127.0.0.1:{config.explorer.metrics_port}"]
    assert jobs["rollout"] == [f"127.0.0.1:{config.launch.rollout_metrics_port_base}"]
    assert jobs["launch"] == [f"127.0.0.1:{config.launch.metrics_port}"]


@pytest.mark.parametrize("host, target",
                         [("::", "127.0.0.1:1"), ("10.0.0.5", "10.0.0.5:1"), ("fd00::1", "[fd00::1]:1")])
def test_targets_on_a_host(host, target):
    from streamrft.scrape_config import _target

    assert _target(host, 1) == target
