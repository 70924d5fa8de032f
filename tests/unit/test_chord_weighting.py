"""CHORD's weighting over the SFT mix: a step whose SFT reader had no rows still weighs the RL loss 1 − μ, and
``mix_weighting: chord`` without SFT rows in the mix is refused when the config loads."""
from __future__ import annotations

import copy

import pytest

from streamrft.config import load_config
from streamrft.engines.algorithms.chord import chord_weights
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.errors import ConfigError

from .test_training_engine import EXPS, tiny_llama

MU = 0.3


def test_chord_weighs_rl_by_one_minus_mu_when_the_step_has_no_sft_rows():
    assert chord_weights(MU, 1.0, 0.0, 0.0) == pytest.approx((0.7, 0.0, 0.0))
    assert chord_weights(MU, 0.8, 0.0, 0.2) == pytest.approx((0.8 * 0.7, 0.0, 0.2))  # DPO keeps its share


@pytest.mark.model
def test_a_chord_step_without_sft_rows_has_the_gradient_of_one_minus_mu_times_the_rl_loss():
    model = tiny_llama()
    plain = TrainingEngine(copy.deepcopy(model), TrainingSettings(lr=1e-3, max_grad_norm=None), device="cpu")
    chord = TrainingEngine(copy.deepcopy(model), TrainingSettings(
        lr=1e-3, max_grad_norm=None, mix_weighting="chord", chord_mu_peak=MU, chord_mu_valley=MU), device="cpu")
    rl_alone, weighted = plain.train_step(EXPS), chord.train_step(EXPS)  # RL rows only: no SFT row came
    assert weighted["mix/chord_mu"] == pytest.approx(MU) and weighted["mix/rl_weight"] == pytest.approx(1 - MU)
    assert weighted["mix/sft_weight"] == 0.0
    assert rl_alone["actor/grad_norm"] > 0
    assert weighted["actor/grad_norm"] == pytest.approx((1 - MU) * rl_alone["actor/grad_norm"], rel=1e-5)


def test_chord_without_sft_rows_in_the_mix_fails_at_load_saying_how_to_fix_it():
    with pytest.raises(ConfigError, match=r"trainer.mix.sft is 0.*set trainer.mix.sft .*or mix_weighting: rows"):
        load_config(overrides={"trainer": {"algorithm": {"mix_weighting": "chord"}}}, env={})
    config = load_config(overrides={"trainer": {"algorithm": {"mix_weighting": "chord"}, "mix": {"sft": 0.25}}},
                         env={})
    assert config.training_settings.mix_weighting == "chord"
