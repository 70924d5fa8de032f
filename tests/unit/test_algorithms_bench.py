"""bench/algorithms.py without a run: every family's config loads with its keys in place (so a renamed key fails
here, not an hour into the bench), the metrics its table shows are declared, and the table's ratios are to the
GRPO row."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrft.config import load_config
from streamrft.metric_catalog import declaration_of

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import algorithms as module
        import demo_runs
    finally:
        sys.path.remove(str(BENCH))
    return module, demo_runs


def _leaves(tree: dict[str, Any], path: tuple[str, ...] = ()):
    """(key path, value) of every scalar or list in a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, path + (key,))
        else:
            yield path + (key,), value


def _at(config: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        config = config[key] if isinstance(config, dict) else getattr(config, key)
    return config


def _load(bench, tmp_path: Path, name: str):
    algorithms, demo_runs = bench
    run = algorithms.family_run(name, max_steps=12, eval_interval=4, max_minutes=5.0)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(demo_runs.demo_config(run, tmp_path / name)))
    return load_config(path, env={})


def test_every_family_loads_with_its_keys_and_the_shared_budget(bench, tmp_path):
    algorithms, _ = bench
    grpo = _load(bench, tmp_path, "grpo").trainer.algorithm
    for name, family in algorithms.FAMILIES.items():
        config = _load(bench, tmp_path, name)
        assert (config.explorer.max_steps, config.explorer.eval_interval) == (12, 4), name
        for path, value in _leaves(family.overrides):
            loaded = _at(config, path)
            if isinstance(value, list):  # data files: their paths are made absolute
                assert len(loaded) == len(value), (name, path)
            else:
                assert loaded == value, (name, path, loaded)
        if name != "grpo":  # every family trains differently from the baseline
            assert config.trainer.algorithm != grpo or config.explorer.dynamic_sampling.enabled, name


def test_the_families_are_what_their_papers_need(bench, tmp_path):
    chord = _load(bench, tmp_path, "chord")
    assert chord.trainer.mix.sft > 0 and Path(chord.launch.data_files[0].path).is_file()
    dapo = _load(bench, tmp_path, "dapo")
    assert dapo.explorer.dynamic_sampling.enabled and dapo.rollout.overlong_penalty.buffer_len > 0
    assert dapo.trainer.algorithm.clip_high > dapo.trainer.algorithm.clip_low
    assert _load(bench, tmp_path, "ppo_gae").trainer.algorithm.uses_critic
    assert _load(bench, tmp_path, "remax").trainer.algorithm.greedy_baseline
    assert _load(bench, tmp_path, "adaptive_kl").trainer.algorithm.needs_reference


def test_every_metric_the_table_shows_is_a_declared_trainer_metric(bench):
    algorithms, _ = bench
    undeclared = [m for m in algorithms.trainer_metrics() if declaration_of(m, "trainer") is None]
    assert not undeclared
    assert "actor/cispo_clip_frac" in algorithms.trainer_metrics()


def test_grpo_runs_first_and_an_unknown_family_is_refused(bench):
    algorithms, _ = bench
    assert algorithms.chosen("cispo, gspo") == ["grpo", "cispo", "gspo"]
    assert algorithms.chosen("gspo,grpo,gspo") == ["grpo", "gspo"]
    with pytest.raises(ValueError, match="unknown family ppo_typo; choose from grpo"):
        algorithms.chosen("grpo,ppo_typo")


def test_the_ratios_are_to_the_grpo_run(bench):
    algorithms, demo_runs = bench
    grpo = demo_runs.DemoResult("grpo", exit_code=0, evals={7: 0.3, 15: 0.5},
                                trainer_means={"time/train_step": 10.0, "actor/pg_clipfrac": 0.01})
    cispo = demo_runs.DemoResult("cispo", exit_code=0, evals={7: 0.4, 15: 0.6},
                                 trainer_means={"time/train_step": 15.0, "actor/cispo_clip_frac": 0.125})
    gspo = demo_runs.DemoResult("gspo", exit_code=1)  # died before any eval or step
    table = algorithms.table([grpo, cispo, gspo], max_steps=16)
    columns = {c.header: list(c.cells) for c in table.columns}
    assert columns["eval / GRPO"] == ["1.00", "1.20", "-"]
    assert columns["step s / GRPO"] == ["1.00", "1.50", "-"]
    assert columns["clip share"] == ["0.010", "0.125", "-"]
    assert columns["eval by step"][1] == "7:0.40 15:0.60"
    assert "cispo: clip actor/cispo_clip_frac" in algorithms.legend(["grpo", "cispo"])
