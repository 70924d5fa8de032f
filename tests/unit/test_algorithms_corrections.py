"""Off-policy corrections (token, sequence and geometric-mean ratios, truncated or masked), the adaptive KL
controller and CHORD's weighting: by hand on small tensors, then through the training engine on a tiny Llama
(the hooks that apply them, their metrics, the controller's checkpoint)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from streamrft.engines.algorithms import IMPORTANCE_CORRECTIONS, KlController, behaviour_weights, no_corrections
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines.training.supervised import sft_backward

from .test_sft_dpo import RL, SFT
from .test_training_engine import EXPS, grads, make_exp, tiny_llama

T = torch.tensor
# behaviour = 0, old = log ratio: row 0 ratios [2, 0.25, 3] (product 1.5, geometric mean 1.5^(1/3) = 1.144714),
# row 1 [1.5, 0.4, masked 9] (product 0.6, geometric mean 0.6^(1/2) = 0.774597)
OLD = torch.log(T([[2.0, 0.25, 3.0], [1.5, 0.4, 9.0]]))
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, T(expected, dtype=torch.float32), atol=atol, rtol=0)


def weights(name, **band):
    return behaviour_weights(OLD, torch.zeros(2, 3), MASK, correction=name, **band)


@pytest.mark.parametrize(("name", "band", "expected", "metric", "share"), [
    # token TIS, cap 2.5: [2, 0.25, 2.5] [1.5, 0.4]; one of the five tokens truncated
    ("tis", {"cap": 2.5}, [[2.0, 0.25, 2.5], [1.5, 0.4, 0.0]], "actor/is_token_truncated_frac", 1 / 5),
    # IcePop, band [0.3, 2.5]: 0.25 and 3 masked, the rest keep their ratio
    ("icepop", {"low": 0.3, "high": 2.5}, [[2.0, 0.0, 0.0], [1.5, 0.4, 0.0]], "actor/is_token_masked_frac", 2 / 5),
    # sequence TIS, cap 1.2: min(1.5, 1.2), min(0.6, 1.2) on every token of the sample
    ("seq_tis", {"cap": 1.2}, [[1.2, 1.2, 1.2], [0.6, 0.6, 0.0]], "actor/is_seq_truncated_frac", 1 / 2),
    # sequence MIS, band [0.7, 2]: 1.5 kept, 0.6 rejected
    ("seq_mis", {"low": 0.7, "high": 2.0}, [[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]], "actor/is_seq_masked_frac", 1 / 2),
    # geometric TIS, cap 1.1: min(1.144714, 1.1), 0.774597
    ("geo_tis", {"cap": 1.1}, [[1.1, 1.1, 1.1], [0.774597, 0.774597, 0.0]], "actor/is_seq_truncated_frac", 1 / 2),
    # geometric MIS, band [0.8, 2]: 1.144714 kept, 0.774597 rejected
    ("geo_mis", {"low": 0.8, "high": 2.0}, [[1.144714] * 3, [0.0, 0.0, 0.0]], "actor/is_seq_masked_frac", 1 / 2),
])
def test_corrections_by_hand(name, band, expected, metric, share):
    got, counts = weights(name, **band)
    close(got, expected)
    metrics = counts.metrics()
    assert metrics[metric] == pytest.approx(share)
    assert no_corrections(correction=name).metric == metric  # the name a rank without corrected rows reports
    assert metrics["actor/is_weight_mean"] == pytest.approx(float((got * MASK).sum() / MASK.sum()), abs=1e-5)


def test_a_correction_leaves_rows_it_does_not_correct_at_weight_one():
    got, counts = behaviour_weights(OLD, torch.zeros(2, 3), MASK, correction="seq_mis", low=0.7, high=2.0,
                                    rows=T([False, True]))
    close(got, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert (counts.flagged, counts.units) == (1.0, 1.0)  # of the one corrected sequence
    # the token correction named tis is the truncated IS the engine has always applied
    from streamrft.engines.algorithms import truncated_importance_weights

    classic = truncated_importance_weights(OLD, torch.zeros(2, 3), MASK, cap=2.5).weights
    torch.testing.assert_close(weights("tis", cap=2.5)[0], classic)


def test_every_correction_is_registered_and_tested_here():
    assert set(IMPORTANCE_CORRECTIONS.names()) == {"tis", "icepop", "seq_tis", "seq_mis", "geo_tis", "geo_mis"}


# ----------------------------------------------------------------------------- adaptive KL controller
def test_adaptive_kl_controller_follows_ziegler_et_al():
    # coef ← coef·(1 + clip(KL/target − 1, ±0.2)·n/horizon); target 0.05, horizon 100, n = 10
    ctrl = KlController(0.1, target=0.05, horizon=100)
    ctrl.update(0.2, n_steps=10)  # error 3 clipped to 0.2: 0.1·1.02
    assert ctrl.coef == pytest.approx(0.102)
    ctrl.update(0.045, n_steps=10)  # error −0.1: ·0.99
    assert ctrl.coef == pytest.approx(0.10098)
    restored = KlController(0.1, target=0.05, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert (restored.coef, restored.updates) == (ctrl.coef, 2)
    restored.load_state_dict(None)  # a checkpoint without a controller's state keeps what it has
    assert restored.coef == ctrl.coef
    fixed = KlController(0.1)
    fixed.update(5.0, n_steps=10)
    assert fixed.coef == 0.1 and not fixed.adaptive
    with pytest.raises(ValueError, match="target > 0"):
        KlController(0.1, target=0.0)


def test_adaptive_kl_needs_a_penalty_to_move():
    with pytest.raises(ValueError, match="kl_penalty_coef"):
        TrainingSettings(kl_ctrl="adaptive")


@pytest.mark.model
def test_the_engine_moves_the_kl_penalty_coefficient_and_checkpoints_it():
    settings = TrainingSettings(lr=1e-3, kl_penalty_coef=0.05, kl_ctrl="adaptive", target_kl=1e-3, kl_horizon=4)
    engine = TrainingEngine(tiny_llama(), settings, device="cpu")
    first = engine.train_step(EXPS)
    # policy == reference: KL 0, error −0.2, 4 samples over a horizon of 4: 0.05 · 0.8
    assert first["actor/kl_coef"] == pytest.approx(0.05) and first["actor/kl_penalty"] == pytest.approx(0, abs=1e-7)
    assert engine.kl_ctrl.coef == pytest.approx(0.04)
    second = engine.train_step(EXPS)
    assert second["actor/kl_coef"] == pytest.approx(0.04)
    resumed = TrainingEngine(tiny_llama(), settings, device="cpu")
    resumed.load_state_dict(engine.state_dict())
    assert resumed.kl_ctrl.coef == pytest.approx(engine.kl_ctrl.coef) and resumed.kl_ctrl.updates == 2


# ----------------------------------------------------------------------------- the engine applies the correction
def _off_policy(engine):
    """Rows whose behaviour logprobs sit off the policy by token ratios 3, 0.5 and 1.5 (sequence ratios 9,
    0.5 and 1.5³ = 3.375 over the trained tokens; geometric means 3, 0.5, 1.5)."""
    current = engine.compute_logprobs(engine.collate(EXPS[:3]))
    return [
        make_exp([1, 2, 3, 4, 5], 3, 1.0, "a", logprobs=(current[0, :2] - math.log(3)).tolist()),
        make_exp([1, 2, 3, 6], 3, 0.0, "a", logprobs=(current[1, :1] + math.log(2)).tolist()),
        make_exp([7, 8, 9, 10, 11, 12], 2, 0.5, "b", action_mask=[1, 0, 1, 1],
                 logprobs=(current[2, :4] - math.log(1.5)).tolist()),
    ]


@pytest.mark.model
@pytest.mark.parametrize(("name", "expected", "metric", "share"), [
    ("seq_mis", [[0.0, 0.0, 0, 0], [0.5, 0, 0, 0], [3.375, 0, 3.375, 3.375]], "actor/is_seq_masked_frac", 1 / 3),
    ("geo_mis", [[0.0, 0.0, 0, 0], [0.5, 0, 0, 0], [1.5, 0, 1.5, 1.5]], "actor/is_seq_masked_frac", 1 / 3),
    ("icepop", [[0.0, 0.0, 0, 0], [0.5, 0, 0, 0], [1.5, 0, 1.5, 1.5]], "actor/is_token_masked_frac", 2 / 6),
])
def test_the_engine_applies_the_named_correction_prepared_or_in_the_pass(name, expected, metric, share):
    settings = TrainingSettings(lr=1e-3, micro_batch_size=2, tis=True, is_correction=name, is_mask_low=0.4,
                                is_mask_high=4.0 if name == "seq_mis" else 2.0)
    separate = TrainingEngine(tiny_llama(), settings, device="cpu")
    in_pass = TrainingEngine(copy.deepcopy(separate.model), settings, device="cpu")
    exps = _off_policy(separate)
    prepared = separate.prepare(exps)
    torch.testing.assert_close(prepared.loss_weights, T(expected), atol=1e-4, rtol=0)
    assert prepared.metrics[metric] == pytest.approx(share)
    batch = in_pass.prepare(exps, one_update=True)
    assert batch.proximal_in_pass
    got = in_pass.backward(batch)
    torch.testing.assert_close(batch.loss_weights, prepared.loss_weights, atol=1e-4, rtol=0)
    assert got[metric] == pytest.approx(share)
    assert got["actor/is_weight_mean"] == pytest.approx(prepared.metrics["actor/is_weight_mean"], rel=1e-4)


@pytest.mark.model
def test_a_loss_gets_its_params_and_reports_its_shares_through_the_engine():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, policy_loss="sapo",
                                                           policy_loss_params={"tau_pos": 2.0, "tau_neg": 3.0}),
                            device="cpu")
    first = engine.train_step(EXPS)
    assert first["actor/sapo_gate_mean"] == pytest.approx(1.0, abs=1e-5)  # one update: ratio 1, gate 1
    dual = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, clip_ratio_c=3.0), device="cpu")
    assert dual.train_step(EXPS)["actor/pg_clipfrac_lower"] == 0.0  # ratio 1: nothing above c
    with pytest.raises(ValueError, match="tau_pos, tau_neg"):
        TrainingSettings(policy_loss="sapo", policy_loss_params={"tau": 1.0})
    with pytest.raises(ValueError, match="clip_ratio_c: not a parameter of policy loss 'gspo'"):
        TrainingSettings(policy_loss="gspo", clip_ratio_c=3.0)


# ----------------------------------------------------------------------------- CHORD over the SFT mix
@pytest.mark.model
def test_chord_weighs_the_rl_and_sft_losses_by_its_schedule():
    """A mixed step under mix_weighting: chord has the gradient of (1 − μ)·L_RL + μ·L_SFT (μ fixed at 0.3 here),
    not the row shares', and its SFT term is CHORD-φ's."""
    model = tiny_llama()
    chord = TrainingSettings(lr=1e-3, max_grad_norm=None, mix_weighting="chord", chord_mu_peak=0.3,
                             chord_mu_valley=0.3, sft_loss="sft_phi")
    engine = TrainingEngine(copy.deepcopy(model), chord, device="cpu")
    metrics = engine.train_step(RL + SFT)
    assert metrics["mix/chord_mu"] == pytest.approx(0.3)
    assert (metrics["mix/rl_weight"], metrics["mix/sft_weight"]) == pytest.approx((0.7, 0.3))
    assert metrics["mix/rl_share"] == pytest.approx(0.5)

    by_hand = TrainingEngine(copy.deepcopy(model), chord, device="cpu")
    by_hand.backward(by_hand.prepare(RL, one_update=True), weight=0.7)
    sft_backward(by_hand, by_hand.collate(SFT), weight=0.3)
    expected, got = grads(by_hand.model), grads(engine.model)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)
    rows = TrainingEngine(copy.deepcopy(model), TrainingSettings(lr=1e-3, max_grad_norm=None), device="cpu")
    rows.train_step(RL + SFT)
    assert any(not torch.allclose(grads(rows.model)[n], got[n], atol=1e-6) for n in got)  # the weighting matters
