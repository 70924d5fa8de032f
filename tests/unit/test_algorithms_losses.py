"""The policy losses beyond PPO (dual-clip, CISPO, SAPO, TOPR, OPMD, CHORD's SFT-φ and schedule), each against its
paper's formula worked out by hand on a small tensor, with a gradient check where a stop-gradient or a clip
decides what trains."""
from __future__ import annotations

import math

import pytest
import torch

from streamrft.engines.algorithms import ADVANTAGES, POLICY_LOSSES, chord_mu
from streamrft.engines.algorithms.chord import chord_weights
from streamrft.engines.training.loss import LossTally

T = torch.tensor


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, T(expected, dtype=torch.float32), atol=atol, rtol=0)


def log_of(*ratios):
    """Current logprobs whose ratio to old logprobs of 0 is ``ratios`` (one row), with gradient."""
    return torch.log(T([list(ratios)])).requires_grad_()


# ----------------------------------------------------------------------------- dual-clip PPO
def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c():
    # ρ = [4, 2, 4, 0.5], A = [-1, -1, +1, -1], ε = 0.2, c = 3 (Ye et al. 2020, Eq. 5):
    # t0: PPO -min(-4, -1.2) = 4 > c·|A| = 3 -> 3, dual-clipped (no gradient)
    # t1: PPO -min(-2, -1.2) = 2 < 3 -> 2, gradient d(ρ)/dlogp = ρ = 2
    # t2: A > 0 untouched by c: -min(4, 1.2) = -1.2, clipped above
    # t3: -min(-0.5, -0.8) = 0.8, clipped below (ρ < 1 - ε)
    logp = log_of(4.0, 2.0, 4.0, 0.5)
    adv, mask = T([[-1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4)
    out = POLICY_LOSSES.get("ppo_clip")(logp, torch.zeros(1, 4), adv, mask, clip_low=0.2, clip_high=0.2,
                                        clip_ratio_c=3.0)
    close(out.token_loss, [[3.0, 2.0, -1.2, 0.8]])
    assert out.clipped.tolist() == [[True, False, True, True]]
    assert out.metrics["pg_clipfrac_lower"].tolist() == [[True, False, False, False]]
    out.token_loss.sum().backward()
    close(logp.grad, [[0.0, 2.0, 0.0, 0.0]])
    # without c the first token trains on its full ratio
    plain = log_of(4.0, 2.0, 4.0, 0.5)
    no_dual = POLICY_LOSSES.get("ppo_clip")(plain, torch.zeros(1, 4), adv, mask, clip_low=0.2, clip_high=0.2)
    close(no_dual.token_loss, [[4.0, 2.0, -1.2, 0.8]])
    no_dual.token_loss.sum().backward()
    close(plain.grad, [[4.0, 2.0, 0.0, 0.0]])
    assert "pg_clipfrac_lower" not in no_dual.metrics
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        POLICY_LOSSES.get("ppo_clip")(plain, torch.zeros(1, 4), adv, mask, clip_ratio_c=0.9)


def test_decoupled_ppo_takes_the_dual_clip_too():
    logp = log_of(4.0)
    out = POLICY_LOSSES.get("decoupled_ppo")(logp, torch.zeros(1, 1), T([[-2.0]]), torch.ones(1, 1),
                                             clip_ratio_c=3.0)
    close(out.token_loss, [[6.0]])  # min(4·2, 3·2)


# ----------------------------------------------------------------------------- CISPO
def test_cispo_clips_the_detached_weight_and_keeps_every_gradient():
    # MiniMax-M1 §3.1: L = -sg(clip(ρ, 1-ε_low, 1+ε_high))·A·log π, ε_low = 1 (no lower bound), ε_high = 0.28
    # ρ = [1.5, 0.5, 1.1, 0.1], A = [1, -1, -1, 1] -> r̂ = [1.28, 0.5, 1.1, 0.1]
    # L = -r̂·A·logp = [-1.28·ln 1.5, -0.5·ln 0.5·... ] = [-0.518995, -0.346574, 0.104841, 0.230259]
    logp = log_of(1.5, 0.5, 1.1, 0.1)
    adv = T([[1.0, -1.0, -1.0, 1.0]])
    out = POLICY_LOSSES.get("cispo")(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_low=1.0, clip_high=0.28)
    close(out.token_loss, [[-0.518995, -0.346574, 0.104841, 0.230259]])
    assert out.metrics["cispo_clip_frac"].tolist() == [[True, False, False, False]]
    assert not out.clipped.any()  # no token loses its gradient, unlike PPO's t0
    out.token_loss.sum().backward()
    # the weight is a constant: dL/dlogp = -r̂·A (differentiating r̂ too would give -r̂·A·(1 + logp) here)
    close(logp.grad, [[-1.28, 0.5, 1.1, -0.1]])
    # a lower bound (ε_low = 0.2) clips the weights of t1 and t3 up to 0.8
    low = POLICY_LOSSES.get("cispo")(log_of(1.5, 0.5, 1.1, 0.1), torch.zeros(1, 4), adv, torch.ones(1, 4),
                                     clip_low=0.2, clip_high=0.28)
    assert low.metrics["cispo_clip_frac"].tolist() == [[True, True, False, True]]


# ----------------------------------------------------------------------------- SAPO
def test_sapo_soft_gate_and_its_gradient():
    # f(r) = σ(τ(r-1))·4/τ, τ = τ_pos (1) for A > 0, τ_neg (2) for A < 0; L = -f(r)·A
    # t0: r = 1, A = +1: f = 0.5·4 = 2 -> -2; gradient -A·4p(1-p)·r = -1
    # t1: r = 2, A = +1: p = σ(1) = 0.731059, f = 2.924234; w = 4p(1-p) = 0.786448, gradient -w·r = -1.572896
    # t2: r = 0.5, A = -1, τ = 2: p = σ(-1) = 0.268941, f = p·2 = 0.537883 -> +0.537883; gradient +w·r = 0.393224
    logp = log_of(1.0, 2.0, 0.5)
    adv = T([[1.0, 1.0, -1.0]])
    out = POLICY_LOSSES.get("sapo")(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), tau_pos=1.0, tau_neg=2.0)
    close(out.token_loss, [[-2.0, -2.924234, 0.537883]])
    close(out.metrics["sapo_gate_mean"], [[1.0, 0.786448, 0.786448]])
    assert not out.clipped.any()
    out.token_loss.sum().backward()
    close(logp.grad, [[-1.0, -1.572896, 0.393224]])


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """At r = 1 the gate is 1 whatever τ: the first update is plain REINFORCE with the advantage."""
    logp = torch.zeros(1, 3, requires_grad=True)
    adv = T([[0.5, -2.0, 1.0]])
    POLICY_LOSSES.get("sapo")(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), tau_pos=0.3, tau_neg=5.0) \
        .token_loss.sum().backward()
    close(logp.grad, [[-0.5, 2.0, -1.0]])


# ----------------------------------------------------------------------------- TOPR
def test_topr_tapers_negative_sequences_by_their_truncated_sequence_ratio():
    # Le Roux et al. 2025: α = 1 for R ≥ 0, min(π(y)/μ(y), 1) for R < 0; L = -sg(α)·A·log π
    # row 0: A = +1, sequence ratio 2·2 = 4 -> α = 1 (no IS on positives): L = -logp = -ln 2 each
    # row 1: A = -1, ratio 0.5·0.8 = 0.4 -> α = 0.4: L = 0.4·logp = [-0.277259, -0.089257]
    # row 2: A = -1, ratio 2 (the masked token is not in it) -> α = 1: L = logp
    logp = torch.log(T([[2.0, 2.0], [0.5, 0.8], [2.0, 7.0]])).requires_grad_()
    adv = T([[1.0, 1.0], [-1.0, -1.0], [-1.0, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    out = POLICY_LOSSES.get("topr")(logp, torch.zeros(3, 2), adv, mask)
    close(out.token_loss * mask, [[-0.693147, -0.693147], [-0.277259, -0.089257], [0.693147, 0.0]])
    assert out.metrics["topr_tapered_frac"].tolist() == [False, True, False]
    (out.token_loss * mask).sum().backward()
    close(logp.grad, [[-1.0, -1.0], [0.4, 0.4], [1.0, 0.0]])  # α is a constant of the gradient


# ----------------------------------------------------------------------------- OPMD
def test_opmd_advantage_baselines():
    # group [1, 0, 0]: mean 1/3 -> [2/3, -1/3, -1/3]
    # logavgexp, τ = 1: log((e + 2)/3) = 0.452832;  τ = 0.5: 0.5·log((e² + 2)/3) = 0.570466
    # singleton [7]: baseline 0 -> 7
    rewards, mask, groups = T([1.0, 0.0, 0.0, 7.0]), torch.ones(4, 1), ["g", "g", "g", "s"]
    opmd = ADVANTAGES.get("opmd")
    close(opmd(rewards, mask, groups), [[2 / 3], [-1 / 3], [-1 / 3], [7.0]])
    close(opmd(rewards, mask, groups, baseline="logavgexp", tau=1.0),
          [[1 - 0.452832], [-0.452832], [-0.452832], [7.0]])
    close(opmd(rewards, mask, groups, baseline="logavgexp", tau=0.5),
          [[1 - 0.570466], [-0.570466], [-0.570466], [7.0]])
    # the stable form agrees with the naive one where the naive one does not overflow, and survives where it does
    big = opmd(T([800.0, 790.0]), torch.ones(2, 1), ["g", "g"], baseline="logavgexp", tau=1.0)
    assert torch.isfinite(big).all()
    close(big, [[800 - (800 + math.log((1 + math.exp(-10)) / 2))], [790 - (800 + math.log((1 + math.exp(-10)) / 2))]],
          atol=1e-3)
    with pytest.raises(ValueError, match="mean or logavgexp"):
        opmd(rewards, mask, groups, baseline="max")


def test_opmd_loss_is_reinforce_scaled_by_one_over_one_plus_tau():
    logp = torch.log(T([[0.5, 0.25]])).requires_grad_()
    out = POLICY_LOSSES.get("opmd")(logp, torch.zeros(1, 2), T([[2.0, -1.0]]), torch.ones(1, 2), tau=1.0)
    close(out.token_loss, [[-2.0 * math.log(0.5) / 2, math.log(0.25) / 2]])
    out.token_loss.sum().backward()
    close(logp.grad, [[-1.0, 0.5]])


# ----------------------------------------------------------------------------- CHORD
def test_sft_phi_weights_each_token_by_p_times_one_minus_p_without_differentiating_it():
    # p = [0.5, 0.9]: φ = [0.25, 0.09]; L = -φ·logp = [0.173287, 0.009482]; dL/dlogp = -φ
    logp = torch.log(T([[0.5, 0.9]])).requires_grad_()
    out = POLICY_LOSSES.get("sft_phi")(logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    close(out.token_loss, [[0.173287, 0.009482]])
    close(out.metrics["sft_phi_weight_mean"], [[0.25, 0.09]])
    out.token_loss.sum().backward()
    close(logp.grad, [[-0.25, -0.09]])


def test_chord_mu_schedule_warms_up_decays_by_cosine_and_stays_at_the_valley():
    args = {"mu_peak": 0.5, "mu_valley": 0.1, "mu_warmup_steps": 4, "mu_decay_steps": 10}
    assert [chord_mu(s, **args) for s in (0, 2, 4)] == pytest.approx([0.0, 0.25, 0.5])
    # halfway through the decay: valley + (peak - valley)·(1 + cos(π/2))/2 = 0.1 + 0.4·0.5 = 0.3
    assert chord_mu(9, **args) == pytest.approx(0.3)
    assert chord_mu(14, **args) == pytest.approx(0.1) and chord_mu(1000, **args) == pytest.approx(0.1)
    assert chord_mu(0, mu_peak=0.2, mu_valley=0.2, mu_warmup_steps=0, mu_decay_steps=0) == pytest.approx(0.2)


def test_chord_weights_split_what_dpo_leaves_between_rl_and_sft():
    assert chord_weights(0.25, 0.8, 0.1, 0.1) == pytest.approx((0.9 * 0.75, 0.9 * 0.25, 0.1))
    assert chord_weights(0.25, 0.0, 1.0, 0.0) == (0.0, 1.0, 0.0)  # no RL rows: nothing to weigh against


# ----------------------------------------------------------------------------- the tally of a loss's shares
def test_loss_shares_average_over_tokens_or_sequences_and_add_up_over_micro_batches():
    tally = LossTally()
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    tally.add_shares({"tok": T([[True, False], [True, True]]), "seq": T([True, False])}, mask)
    tally.add_shares({"tok": T([[False, False]]), "seq": T([True])}, T([[1.0, 1.0]]))
    metrics = tally.metrics(num_tokens=5.0, with_reference=False)
    assert metrics["actor/tok"] == pytest.approx(2 / 5)  # the masked True is not counted
    assert metrics["actor/seq"] == pytest.approx(2 / 3)

    class TwoRanks:  # every rank held the same tally: sums double, shares stay
        @staticmethod
        def sum(values):
            return [2 * v for v in values]

        @staticmethod
        def max(value):
            return value

    tally.reduce(TwoRanks())
    again = tally.metrics(num_tokens=10.0, with_reference=False)
    assert again["actor/tok"] == pytest.approx(2 / 5) and again["actor/seq"] == pytest.approx(2 / 3)
