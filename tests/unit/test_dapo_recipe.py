"""``examples/dapo.yaml``, the DAPO recipe on the demo task: it loads, and what it sets reaches the engines as DAPO
has it (clip-higher, token-level loss, no KL, dynamic sampling, soft overlong punishment)."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamrft.config import load_config
from streamrft.engines.rollout import OverlongShaping
from streamrft.engines.rollout.reward_shaping import overlong_penalty
from streamrft.producers.task_files import FieldMapping, read_tasks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipe(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example names its files from the repository root
    return load_config(ROOT / "examples" / "dapo.yaml", env={})


def test_the_recipe_trains_with_clip_higher_a_token_level_loss_and_no_kl(recipe):
    settings = recipe.training_settings
    assert (settings.advantage, settings.policy_loss) == ("grpo", "ppo_clip")
    assert (settings.clip_low, settings.clip_high) == (0.2, 0.28)
    assert settings.loss_agg == "token-mean"
    assert settings.kl_coef == 0 and settings.kl_penalty_coef == 0 and not settings.needs_reference  # no KL


def test_the_recipe_samples_dynamically_and_punishes_overlong_answers(recipe):
    sampling = recipe.explorer.dynamic_sampling
    assert sampling.enabled and sampling.metric == "accuracy" and recipe.explorer.over_rollout.ratio == 0
    max_tokens = recipe.rollout.sampling.max_tokens
    shaping = OverlongShaping(recipe.rollout.overlong_penalty, max_tokens)  # what the worker builds from it
    expected = max_tokens - shaping.settings.buffer_len
    assert 0 < expected < max_tokens  # answers up to `expected` tokens are not punished, longer ones are
    assert overlong_penalty(expected, max_tokens, shaping.settings.buffer_len) == 0.0
    assert overlong_penalty(max_tokens, max_tokens, shaping.settings.buffer_len,
                            shaping.settings.penalty_factor) == -1.0


def test_the_recipes_tasks_are_the_demo_tasks(recipe):
    (task_file,) = recipe.launch.task_files
    tasks = list(read_tasks(task_file.path, FieldMapping.from_task_file(task_file)))
    assert len(tasks) >= recipe.explorer.batch_size * 2 and {t.workflow for t in tasks} == {"arithmetic"}
