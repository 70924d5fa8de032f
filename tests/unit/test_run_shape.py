"""Which roles a run has and what its trainer reads (streamrft/run_shape.py), for every mode; the top-level
``mode`` key, the old ``explorer.mode`` that still loads, and the answers of the roles built on them."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from streamrft.config import load_config
from streamrft.errors import ConfigError
from streamrft.pacing import Pacing
from streamrft.run_shape import Mode, RunShape, TrainerInput

MIX = {"trainer": {"mix": {"sft": 0.1}}}


@pytest.mark.parametrize("mode, mix, roles, trainer_input", [
    ("both", False, ("explorer", "rollout", "trainer", "monitor"), TrainerInput.RL),
    ("both", True, ("explorer", "rollout", "trainer", "monitor"), TrainerInput.RL_WITH_SUPERVISED),
    ("explore", False, ("explorer", "rollout", "monitor"), TrainerInput.NONE),
    ("explore", True, ("explorer", "rollout", "monitor"), TrainerInput.NONE),
    ("train", False, ("trainer", "monitor"), TrainerInput.SUPERVISED),
])
def test_each_mode_has_its_roles_and_its_trainer_input(mode, mix, roles, trainer_input):
    shape = load_config(overrides={"mode": mode, **(MIX if mix else {})}, env={}).shape
    assert shape == RunShape(Mode(mode), mixes_supervised=mix)
    assert shape.roles == roles
    assert shape.trainer_input == trainer_input
    assert shape.has_explorer == ("explorer" in roles) == ("rollout" in roles)
    assert shape.has_trainer == ("trainer" in roles)


def test_the_questions_agree_with_each_other():
    for mode in Mode:
        for mix in (False, True):
            if mode == Mode.TRAIN and mix:
                continue
            shape = RunShape(mode, mixes_supervised=mix)
            assert shape.paces_on_trainer == (shape.has_explorer and shape.has_trainer)
            assert shape.trainer_reads_supervised_only == (shape.has_trainer and not shape.has_explorer)
            assert shape.trainer_mixes_supervised == (shape.paces_on_trainer and mix)
            assert shape.input_topic == ("tasks" if shape.has_explorer else "experiences")


def test_only_a_run_with_explorer_and_trainer_paces_on_the_trainer():
    assert [Pacing.of(load_config(overrides={"mode": m}, env={})).paced for m in ("both", "explore", "train")] == \
        [True, False, False]


def test_mix_in_mode_train_is_refused_saying_how_to_fix_it():
    with pytest.raises(ConfigError, match="mode train has no RL rows .*: remove trainer.mix"):
        load_config(overrides={"mode": "train", **MIX}, env={})


def test_an_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="mode"):
        load_config(overrides={"mode": "serve"}, env={})


def test_the_mode_comes_from_the_environment():
    assert load_config(env={"STREAMRFT_MODE": "explore"}).shape.roles == ("explorer", "rollout", "monitor")


def test_explorer_mode_still_loads_with_a_deprecation_message(caplog):
    with caplog.at_level(logging.WARNING):
        config = load_config(overrides={"explorer": {"mode": "train"}}, env={})
    assert config.mode == "train" and not config.shape.has_explorer
    assert "explorer.mode is deprecated; write it as mode" in caplog.text
    assert load_config(env={"STREAMRFT_EXPLORER__MODE": "explore"}).mode == "explore"


def test_explorer_mode_and_mode_may_agree_but_not_differ():
    same = load_config(overrides={"mode": "explore", "explorer": {"mode": "explore"}}, env={})
    assert same.mode == "explore"
    with pytest.raises(ConfigError, match="explorer.mode and mode are both set, to different values; keep mode"):
        load_config(overrides={"mode": "both", "explorer": {"mode": "train"}}, env={})


MODE_NAMES = {mode.value for mode in Mode}


def _names_a_mode(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in MODE_NAMES:
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_mode(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Mode"


def _reads_a_mode(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "mode"


def test_no_code_but_the_run_shape_compares_the_mode():
    """Callers ask RunShape questions; a ``mode == "train"`` elsewhere is a second owner of the concept."""
    root = Path(__file__).resolve().parents[2]
    home = root / "streamrft" / "run_shape.py"
    found = []
    for folder in ("streamrft", "consumers", "producers", "engines"):
        for path in sorted((root / folder).rglob("*.py")):
            if path == home:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare) and any(_reads_a_mode(p) for p in (node.left, *node.comparators)) \
                        and any(_names_a_mode(p) for p in (node.left, *node.comparators)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"the run's mode compared outside streamrft/run_shape.py: {found}"


@pytest.mark.parametrize("mode, supervised_alone", [("both", False), ("train", True)])
def test_the_trainers_batch_rule_follows_the_shape(mode, supervised_alone):
    from streamrft.consumers.trainer.batches import BatchPicker
    from streamrft.consumers.trainer.group_buffer import GroupBuffer

    config = load_config(overrides={"mode": mode}, env={})
    picker = BatchPicker(config, GroupBuffer(config.explorer.repeat_times), consumer=None, clients=None, sync=None)
    assert picker.supervised_alone is supervised_alone
