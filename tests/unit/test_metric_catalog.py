"""The one declaration of every metric name (streamrft/metric_catalog): every Prometheus series the roles create
is declared and made only from its declaration, the names the roles write to the metrics topic are declared for
their role (strictly in the tests), and the generated reference page is current."""
from __future__ import annotations

import ast
import importlib
import logging
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from streamrft.metric_catalog import (PROMETHEUS_BY_NAME, PROMETHEUS_METRICS, STRICT_ENV, TOPIC_METRICS,
                                      UndeclaredMetric, check_emitted, declaration_of, prometheus_metric)
from streamrft.metric_catalog.topic_metrics import PLACEHOLDERS, TOPIC_ROLES
from streamrft.reference import metrics_page

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("streamrft", "engines", "consumers", "producers", "schemas", "bench")
FACTORY_HOME = "streamrft/metric_catalog/prometheus_metrics.py"
METRIC_CLASSES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
ROLE_MODULES = ("streamrft.runtime.role_runtime", "streamrft.weights.follower", "streamrft.weights.refusals",
                "streamrft.launch.metrics", "streamrft.consumers.explorer.role", "streamrft.consumers.rollout.role",
                "streamrft.consumers.trainer.role", "streamrft.consumers.monitor", "streamrft.consumers.serve.role",
                "streamrft.consumers.bench")
KNOWN_ROLES = {"explorer", "rollout", "trainer", "monitor", "serve", "bench", "launcher"}


def sources():
    for folder in SOURCE_FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def families(registry: CollectorRegistry) -> dict[str, tuple[str, list[set[str]]]]:
    """name -> (type, the label names of each sample) of what ``registry`` collects."""
    return {family.name: (family.type, [set(sample.labels) for sample in family.samples])
            for family in registry.collect()}


def assert_declared(registry: CollectorRegistry) -> set[str]:
    found = families(registry)
    for name, (kind, labels) in found.items():
        declared = PROMETHEUS_BY_NAME.get(name) or next(
            (m for m in PROMETHEUS_METRICS if m.is_family and m.matches(name)), None)
        assert declared is not None, f"{name} is not declared in {FACTORY_HOME}"
        assert kind == declared.kind, name
        assert all(sample == set(declared.labels) for sample in labels), (name, labels)
    return set(found)


# -- Prometheus ------------------------------------------------------------------------------------------------
def test_every_series_registered_after_importing_the_roles_is_declared():
    """Importing the roles registers nothing of theirs on prometheus_client's global registry (each role has a
    registry of its own); what is there is prometheus_client's own process and platform collectors."""
    for module in ROLE_MODULES:
        importlib.import_module(module)
    foreign = {name for name in families(REGISTRY) if not re.match(r"(process|python)_", name)}
    undeclared = {name for name in foreign if name not in PROMETHEUS_BY_NAME}
    assert not undeclared, f"registered on the global registry without a declaration: {sorted(undeclared)}"


class _Clients:
    def producer(self, **kwargs):
        return object()


class _Core:
    swaps_in_flight = 0


def test_the_roles_series_are_made_from_their_declarations(run_config_offline):
    """The series of the runtime and of each role's metrics holder, on a registry each: all declared, with the
    declared type and labels (a labelled series shows its labels once a child exists)."""
    from streamrft.consumers.lag_gauges import GroupLagGauges
    from streamrft.consumers.monitor import PrometheusExport, Row
    from streamrft.consumers.rollout.metrics import RolloutMetrics
    from streamrft.consumers.trainer.metrics import TrainerMetrics
    from streamrft.launch.metrics import LauncherMetrics
    from streamrft.lifecycle import StopSignal
    from streamrft.runtime import RoleRuntime
    from streamrft.weights.refusals import Refusals

    runtime = RoleRuntime(run_config_offline, _Clients(), StopSignal(signals=()), role="trainer", source="t",
                          follows_sync=False)
    runtime._count_dead_letter("tasks", "schema")
    trainer = TrainerMetrics(runtime, None)
    trainer.drop("stale", 1)
    seen = assert_declared(runtime.registry)
    assert {"streamrft_dead_letters", "streamrft_group_rejoins", "streamrft_trainer_step",
            "streamrft_trainer_experiences_dropped"} <= seen

    registry = CollectorRegistry()
    LauncherMetrics(["explorer"], registry)
    rollout = RolloutMetrics(registry, _Core())
    rollout.committed(["OK"])
    Refusals("w", registry, retry_initial_s=1, retry_max_s=2, retry_attempts=1, clock=lambda: 0.0) \
        .c_refused.labels("digest").inc()
    GroupLagGauges(registry, clients=None).gauge.labels("g", "t").set(1)
    export = PrometheusExport(registry)
    export.update(Row(step=1, role="explorer", source="e", name="eval/gsm8k/mean@4", value=0.5, created_at=0))
    export.records.labels("exported").inc()
    seen = assert_declared(registry)
    assert {"streamrft_role_up", "streamrft_rollout_requests", "streamrft_rollout_swaps_in_flight",
            "streamrft_rollout_weights_refused", "streamrft_consumer_group_lag_records", "streamrft_metric_step",
            "streamrft_eval_gsm8k_mean_4"} <= seen


def test_no_series_is_made_outside_the_catalog():
    """prometheus_client's metric classes are used in the factory only, so a series cannot exist without a
    declaration; every name given to the factory is declared, and every declared name is used."""
    direct, named = [], set()
    for path in sources():
        place = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "prometheus_client" and place != FACTORY_HOME:
                direct += [f"{place}:{node.lineno} {a.name}" for a in node.names if a.name in METRIC_CLASSES]
            if isinstance(node, ast.Attribute) and node.attr in METRIC_CLASSES and \
                    isinstance(node.value, ast.Name) and node.value.id == "prometheus_client":
                direct.append(f"{place}:{node.lineno} prometheus_client.{node.attr}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and place != FACTORY_HOME:
                named.add(node.value)
    assert not direct, f"create Prometheus series with streamrft.metric_catalog.prometheus_metric: {direct}"
    unused = {m.name for m in PROMETHEUS_METRICS if not m.is_family} - named
    assert not unused, f"declared but never created (remove them from {FACTORY_HOME}): {sorted(unused)}"


def test_the_factory_refuses_an_undeclared_series():
    registry = CollectorRegistry()
    with pytest.raises(UndeclaredMetric, match=f"'streamrft_made_up'.*{FACTORY_HOME}"):
        prometheus_metric("streamrft_made_up", registry)
    with pytest.raises(UndeclaredMetric, match="not declared"):  # a family is only made as one
        prometheus_metric("streamrft_{metric}", registry)
    with pytest.raises(UndeclaredMetric, match="family"):
        prometheus_metric("other_rollout_reward", registry, family="streamrft_{metric}")
    counter = prometheus_metric("streamrft_explorer_results", registry)
    counter.labels("OK").inc()
    assert registry.get_sample_value("streamrft_explorer_results_total", {"status": "OK"}) == 1.0


def test_prometheus_declarations_are_well_formed():
    names = [m.name for m in PROMETHEUS_METRICS]
    assert len(names) == len(set(names))
    for m in PROMETHEUS_METRICS:
        assert re.fullmatch(r"streamrft_[a-z0-9_{}]+", m.name) and m.help and m.unit, m
        assert set(m.roles) <= KNOWN_ROLES, m


# -- the metrics topic -----------------------------------------------------------------------------------------
def test_topic_declarations_are_well_formed():
    keys = [(m.name, role) for m in TOPIC_METRICS for role in m.roles]
    assert len(keys) == len(set(keys))
    for m in TOPIC_METRICS:
        assert set(re.findall(r"\{(\w+)\}", m.name)) <= set(PLACEHOLDERS), m
        assert set(m.roles) <= set(TOPIC_ROLES) and m.unit and m.meaning, m


def test_an_undeclared_name_fails_the_strict_check_naming_it_and_where_to_declare_it(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(UndeclaredMetric, match=r"'actor/made_up'.*trainer.*streamrft/metric_catalog/"
                                               r"topic_metrics\.py"):
        check_emitted({"actor/pg_loss": 1.0, "actor/made_up": 2.0}, "trainer")
    with pytest.raises(UndeclaredMetric, match="'actor/pg_loss' written by the explorer"):  # declared, not for it
        check_emitted(["actor/pg_loss"], "explorer")
    check_emitted(["eval/gsm8k/mean@4", "rollout/taskset/math/accuracy"], "explorer")
    with pytest.raises(UndeclaredMetric, match="mean@four"):  # {k} is a number
        check_emitted(["eval/gsm8k/mean@four"], "explorer")


def test_the_publisher_checks_before_it_writes(monkeypatch):
    from streamrft.telemetry import MetricsPublisher

    class Producer:
        def __init__(self):
            self.records = []

        def produce(self, topic, record):
            self.records.append(record)

    producer = Producer()
    publisher = MetricsPublisher(producer, "rft.t.metrics", "w0", "rollout")
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(UndeclaredMetric, match="rollout_worker/made_up"):
        publisher.publish(3, {"rollout_worker/samples": 4.0, "rollout_worker/made_up": 1.0})
    assert producer.records == []  # nothing of a refused record set is written
    publisher.publish(3, {"rollout_worker/samples": 4.0, "judge/failed_samples": 1.0})
    assert [r.name for r in producer.records] == ["rollout_worker/samples", "judge/failed_samples"]


def test_outside_the_tests_an_undeclared_name_is_a_warning_once(monkeypatch, caplog):
    monkeypatch.setenv(STRICT_ENV, "0")
    with caplog.at_level(logging.WARNING, "streamrft.metric_catalog"):
        check_emitted(["trainer/made_up_once"], "trainer")
        check_emitted(["trainer/made_up_once"], "trainer")
    warned = [r for r in caplog.records if "trainer/made_up_once" in r.getMessage()]
    assert len(warned) == 1 and "topic_metrics.py" in warned[0].getMessage()


def test_the_explorer_and_worker_metrics_are_declared():
    """What the pure metric functions build, with every branch that adds names."""
    from streamrft.consumers.rollout.metrics import RolloutMetrics
    from streamrft.rollout_stats import eval_metrics, retry_metrics, step_metrics, taskset_metrics
    from streamrft.schemas import RolloutResult, RolloutStatus

    def result(status=RolloutStatus.OK, n=2, taskset="math"):
        return RolloutResult(request_id="r", step=3, task_id="t", taskset=taskset, status=status, n=n,
                             reward_mean=0.5, reward_std=0.5, reward_min=0.0, reward_max=1.0, accuracy=0.5,
                             model_version=2, duration_ms=10, worker_id="w")

    results = [result(), result(RolloutStatus.FAILED, 0)]
    explorer = {**step_metrics(results, 3, 2, 2), **taskset_metrics(results, ["math", "code"]),
                **retry_metrics(results), **eval_metrics("gsm8k", results, 4), **eval_metrics("empty", [], 4)}
    assert {"rollout/reward_mean", "eval/gsm8k/mean@4", "eval/empty/failed"} <= set(explorer)
    assert [n for n in explorer if declaration_of(n, "explorer") is None] == []

    class Core:
        running, swaps_in_flight = 1, 0

    worker = RolloutMetrics(CollectorRegistry(), Core())
    worker._unscored["judge"] += 1
    worker._penalties += [-0.5, 0.0]
    names = worker.of_commit(2, 4)
    assert {"judge/failed_samples", "rollout_worker/overlong_penalty_mean"} <= set(names)
    assert [n for n in names if declaration_of(n, "rollout") is None] == []


def test_every_policy_loss_reports_declared_names():
    """A policy loss's own metrics are written as ``actor/<name>``: those of every registered loss are declared."""
    import torch

    from streamrft.engines.algorithms.catalog import POLICY_LOSSES
    from streamrft.engines.training import TrainingSettings

    logprobs, old = torch.full((2, 3), -1.0), torch.full((2, 3), -1.2)
    advantages, mask = torch.tensor([[1.0] * 3, [-1.0] * 3]), torch.ones(2, 3)
    for name in POLICY_LOSSES.names():
        extra = {"clip_ratio_c": 3.0} if name == "ppo_clip" else {}
        kwargs = TrainingSettings(policy_loss=name, **extra).policy_loss_kwargs
        out = POLICY_LOSSES.get(name)(logprobs, old, advantages, mask, **kwargs)
        undeclared = [f"actor/{k}" for k in out.metrics if declaration_of(f"actor/{k}", "trainer") is None]
        assert undeclared == [], name


TRAINER_SETTINGS = {  # settings, names the step must report among others
    # a dual-clip PPO step with a reference's KL (loss and adaptive reward penalty), masked truncated samples and
    # a sequence-level correction of the stale row
    "rl": ({"clip_ratio_c": 3.0, "kl_coef": 0.1, "kl_penalty_coef": 0.05, "kl_ctrl": "adaptive", "target_kl": 1e-3,
            "mask_truncated": True, "is_correction": "seq_mis", "tis": True},
           {"actor/pg_clipfrac_lower", "actor/kl", "actor/kl_penalty", "actor/num_masked_truncated",
            "actor/is_seq_masked_frac", "actor/is_weight_mean"}),
    "chord-mix": ({"mix_weighting": "chord", "chord_mu_peak": 0.3, "chord_mu_valley": 0.3},
                  {"mix/chord_mu", "sft/loss", "dpo/loss"}),
    "critic": ({"advantage": "gae", "critic": {"lr": 1e-3}}, {"critic/vf_loss", "critic/value_explained_var"}),
}


@pytest.mark.model
@pytest.mark.parametrize(("settings", "reported"), TRAINER_SETTINGS.values(), ids=TRAINER_SETTINGS.keys())
def test_the_training_engine_metrics_are_declared(settings, reported):
    """One step of the training engine on a tiny Llama, RL rows (one stale) and, with a mix, SFT and DPO rows:
    every name it returns is declared for the trainer."""
    from streamrft.engines.training import TrainingEngine, TrainingSettings

    from .test_sft_dpo import DPO, RL, SFT
    from .test_training_engine import EXPS, tiny_llama

    engine = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, **settings), device="cpu")
    rows = RL + SFT + DPO if "mix_weighting" in settings else EXPS
    metrics = engine.train_step(rows, needs_correction=[i == 0 for i in range(len(rows))])
    assert {"actor/loss", "actor/grad_norm"} | reported <= set(metrics)
    assert [n for n in metrics if declaration_of(n, "trainer") is None] == []


# -- the page --------------------------------------------------------------------------------------------------
def test_the_metrics_page_is_current():
    page = ROOT / metrics_page.PATH
    assert page.read_text() == metrics_page.render(), (
        f"{metrics_page.PATH} is out of date: run `python -m streamrft.reference`")


def test_the_page_lists_every_declaration_once():
    text = metrics_page.render()
    assert text.startswith("<!-- Generated by `python -m streamrft.reference`")
    for m in PROMETHEUS_METRICS:
        assert text.count(f"| `{m.exposed}` |") == 1, m.name
    for m in TOPIC_METRICS:
        assert text.count(f"| `{m.name}` |") == len(m.roles) == 1, m.name


@pytest.fixture
def run_config_offline():
    from streamrft.config import load_config

    return load_config(overrides={"name": "catalog"}, env={})
