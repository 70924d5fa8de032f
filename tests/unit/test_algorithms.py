"""Every registry entry against a hand-computed example (numbers worked out in the comments)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from streamrft.engines.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    Registry,
    StalenessPolicy,
    apply_staleness,
    kl_penalty,
    rloo,
    truncated_importance_weights,
)

T = torch.tensor
# The entries with a hand-computed example, here or in test_algorithms_losses.py (opmd, cispo, sapo, topr,
# sft_phi), test_algorithms_corrections.py (the importance corrections) and test_critic.py (gae); a new registry
# entry must be added here (with its test).
COVERED = {
    "advantage": {"grpo", "grpo_reward_to_go", "dr_grpo", "rloo", "reinforce_plus_plus", "distill", "opmd", "gae",
                  "remax", "gigpo", "step_grpo"},  # test_remax.py, test_gigpo.py
    "loss": {"ppo_clip", "decoupled_ppo", "gspo", "sft", "cispo", "sapo", "topr", "opmd", "sft_phi"},
    "kl": {"k1", "k2", "k3"},
    "agg": {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean"},
}


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, T(expected, dtype=torch.float32), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- advantages
def test_grpo_group_mean_and_unbiased_std():
    # group a = [1, 0, 0]: mean 1/3, deviations (2/3, -1/3, -1/3), unbiased var (4/9+1/9+1/9)/2 = 1/3
    # -> A = (2/3)/sqrt(1/3) = 1.154701, -0.577350, -0.577350.  group b: equal rewards -> 0.  c: singleton -> 0.
    rewards = T([1.0, 0.0, 0.0, 0.5, 0.5, 7.0])
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1]], dtype=torch.float32)
    adv = ADVANTAGES.get("grpo")(rewards, mask, ["a", "a", "a", "b", "b", "c"])
    close(adv, [[1.154701, 1.154701], [-0.577350, 0], [-0.577350, -0.577350], [0, 0], [0, 0], [0, 0]], atol=1e-4)


def test_grpo_reward_to_go_credits_each_turn_with_the_rewards_from_it_on():
    # Two episodes of one group, model turns at tokens 0-1 and 3-4 (token 2 is the environment's, mask 0).
    # Episode 0: outcome 1, turn rewards 0.5 (end of turn 1) and 0.25 (end of turn 2): score 1.75; episode 1: 0.
    # Baseline: mean 0.875, unbiased std sqrt((0.875² + 0.875²) / 1) = 1.237437.
    # Episode 0, turn 1 still collects 1 + 0.5 + 0.25 = 1.75 -> 0.875 / 1.237437 = 0.707107;
    #            turn 2 collects 1 + 0.25 = 1.25 -> 0.375 / 1.237437 = 0.303046.
    # Episode 1 collects 0 everywhere -> -0.707107; the environment's token stays 0.
    mask = T([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.float32)
    token_rewards = T([[0, 0.5, 0, 0, 0.25], [0, 0, 0, 0, 0]])
    adv = ADVANTAGES.get("grpo_reward_to_go")(T([1.0, 0.0]), mask, ["g", "g"], token_rewards=token_rewards,
                                              epsilon=0.0)
    close(adv, [[0.707107, 0.707107, 0, 0.303046, 0.303046], [-0.707107, -0.707107, 0, -0.707107, -0.707107]])
    # without turn rewards it is grpo
    plain = ADVANTAGES.get("grpo_reward_to_go")(T([1.0, 0.0]), mask, ["g", "g"])
    torch.testing.assert_close(plain, ADVANTAGES.get("grpo")(T([1.0, 0.0]), mask, ["g", "g"]))


def test_dr_grpo_no_std():
    # [1, 0, 0] - 1/3 ; padded column stays 0
    mask = T([[1, 1], [1, 1], [1, 0]], dtype=torch.float32)
    adv = ADVANTAGES.get("dr_grpo")(T([1.0, 0.0, 0.0]), mask, [7, 7, 7])
    close(adv, [[2 / 3, 2 / 3], [-1 / 3, -1 / 3], [-1 / 3, 0]])


def test_dense_token_rewards_join_the_sequence_score():
    # scores = reward + sum of trained token rewards = [1 - 0.5, 0 + 0.25] = [0.5, 0.25]; the 9.0 is masked
    mask = T([[1, 1], [1, 0]], dtype=torch.float32)
    token_rewards = T([[0.0, -0.5], [0.25, 9.0]])
    adv = ADVANTAGES.get("dr_grpo")(T([1.0, 0.0]), mask, ["g", "g"], token_rewards=token_rewards)
    close(adv, [[0.125, 0.125], [-0.125, 0]])


def test_rloo_leave_one_out_baseline():
    # group [1, 0, 0]: 1 - mean(0, 0) = 1 ; 0 - mean(1, 0) = -0.5 (twice).  group [3, 1]: +2, -2.
    mask = torch.ones(5, 1)
    adv = ADVANTAGES.get("rloo")(T([1.0, 0.0, 0.0, 3.0, 1.0]), mask, ["x", "x", "x", "y", "y"])
    close(adv, [[1.0], [-0.5], [-0.5], [2.0], [-2.0]])


def test_reinforce_plus_plus_discounted_returns_whitened_over_batch():
    # gamma 0.5. row 0 (3 tokens, reward 1 on the last): G = [0.25, 0.5, 1]
    # row 1 (2 tokens, reward 2 on token 1): G = [1, 2]
    # valid G = [0.25, 0.5, 1, 1, 2]: mean 0.95, deviations (-0.7, -0.45, 0.05, 0.05, 1.05),
    # unbiased var 1.8/4 = 0.45, std 0.670820
    mask = T([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv = ADVANTAGES.get("reinforce_plus_plus")(T([1.0, 2.0]), mask, ["a", "b"], gamma=0.5)
    s = math.sqrt(0.45)
    close(adv, [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]], atol=1e-4)


def test_reinforce_plus_plus_skips_untrained_tokens():
    # mask [1, 0, 1, 1], token reward 0.5 on token 0 (the 9.0 sits on an environment token: ignored),
    # outcome 1 on token 3, gamma 0.5: G3 = 1, G2 = 0.5, token 1 skipped, G0 = 0.5 + 0.5*0.5 = 0.75
    # valid G = [0.75, 0.5, 1]: mean 0.75, unbiased std 0.25 -> A = [0, -, -1, 1]
    mask = T([[1, 0, 1, 1]], dtype=torch.float32)
    adv = ADVANTAGES.get("reinforce_plus_plus")(
        T([1.0]), mask, ["a"], token_rewards=T([[0.5, 9.0, 0.0, 0.0]]), gamma=0.5
    )
    close(adv, [[0.0, 0.0, -1.0, 1.0]], atol=1e-4)


def test_reinforce_plus_plus_group_baseline():
    # outcome minus group mean: [0.5, -0.5]; whitened: mean 0, unbiased std sqrt(0.5)
    adv = ADVANTAGES.get("reinforce_plus_plus")(T([1.0, 0.0]), torch.ones(2, 1), ["g", "g"], group_baseline=True)
    close(adv, [[0.5 / math.sqrt(0.5)], [-0.5 / math.sqrt(0.5)]], atol=1e-4)


def test_distill_is_the_teacher_minus_the_behaviour_logprob_on_trained_tokens():
    behaviour = T([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    teacher = T([[-0.5, -4.0, -0.5], [-1.0, -0.2, -7.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # row 2: one token, then an environment token, padding
    got = ADVANTAGES.get("distill")(T([5.0, -5.0]), mask, ["a", "b"], teacher_logprobs=teacher,
                                    behaviour_logprobs=behaviour)
    close(got, [[0.5, -2.0, 0.0], [2.0, 0.0, 0.0]])  # rewards play no part; more on it in test_distillation.py


# ----------------------------------------------------------------------------- policy losses
def test_ppo_clip_asymmetric_bounds_and_gradients():
    # ratio = [1.5, 0.5, 1.1, 0.7], A = [1, -1, -1, 1], clip_low 0.2, clip_high 0.28 (DAPO clip-higher)
    # t0: min(1.5, 1.28)*1 -> loss -1.28, clipped      t1: min(-0.5, -0.8) -> loss 0.8, clipped
    # t2: min(-1.1, -1.1) -> loss 1.1                   t3: min(0.7, 0.8) -> loss -0.7 (not clipped)
    logp = torch.log(T([[1.5, 0.5, 1.1, 0.7]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = T([[1.0, -1.0, -1.0, 1.0]])
    out = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    close(out.token_loss, [[-1.28, 0.8, 1.1, -0.7]])
    assert out.clipped.tolist() == [[True, True, False, False]]
    close(out.ratio, [[1.5, 0.5, 1.1, 0.7]])
    out.token_loss.sum().backward()
    # d(-ratio*A)/dlogp = -ratio*A where unclipped, 0 where clipped
    close(logp.grad, [[0.0, 0.0, 1.1, -0.7]])


def test_decoupled_ppo_clips_against_the_proximal_policy_and_reweights_by_the_behaviour_one():
    # π_θ / π_prox = r = [1.5, 0.5, 1.1, 0.7] (the proximal policy: the weights at train time, log 0 here);
    # π_prox / π_behav = [2.5, 1, 0.5, 1] (the tokens were sampled by older weights) -> w, capped at 2: [2, 1, .5, 1]
    # surrogate as PPO's against π_prox: [-1.28, 0.8, 1.1, -0.7]; weighted: [-2.56, 0.8, 0.55, -0.7]
    logp = torch.log(T([[1.5, 0.5, 1.1, 0.7]])).requires_grad_()
    proximal = torch.zeros(1, 4)
    behaviour = torch.log(T([[0.4, 1.0, 2.0, 1.0]]))
    adv = T([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    out = POLICY_LOSSES.get("decoupled_ppo")(logp, proximal, adv, mask, clip_low=0.2, clip_high=0.28)
    w = truncated_importance_weights(proximal, behaviour, mask, cap=2.0).weights
    close(w, [[2.0, 1.0, 0.5, 1.0]])
    close(out.token_loss * w, [[-2.56, 0.8, 0.55, -0.7]])
    assert out.clipped.tolist() == [[True, True, False, False]]
    (out.token_loss * w).sum().backward()
    close(logp.grad, [[0.0, 0.0, 0.55, -0.7]])  # −w·r·A where unclipped


def test_gspo_sequence_ratio_and_gradient():
    # row 0 log-ratios [0.2, -0.1] -> s0 = exp(0.05) = 1.051271, A = +1, clip_high 0.04 -> 1.04, clipped
    # row 1 log-ratios [0.3, (masked)] -> s1 = exp(0.3) = 1.349859, A = -1: min(-1.3499, -1.1) -> loss 1.349859
    old = torch.zeros(2, 2)
    logp = T([[0.2, -0.1], [0.3, 5.0]]).requires_grad_()
    mask = T([[1, 1], [1, 0]], dtype=torch.float32)
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    out = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, clip_low=0.1, clip_high=0.04)
    close(out.token_loss[0], [-1.04, -1.04])
    close(out.token_loss[1, :1], [1.349859])
    assert out.clipped.tolist() == [[True, True], [False, False]]
    (out.token_loss * mask).sum().backward()
    # token form: d/dlogp_t of -sg(s)*exp(logp_t - sg(logp_t))*A = -s*A; clipped row -> 0
    close(logp.grad, [[0.0, 0.0], [1.349859, 0.0]])


def test_sft_is_negative_log_likelihood():
    logp = T([[-0.5, -2.0]])
    out = POLICY_LOSSES.get("sft")(logp, torch.zeros(1, 2), T([[5.0, -5.0]]), torch.ones(1, 2))
    close(out.token_loss, [[0.5, 2.0]])
    assert not out.clipped.any()


# ----------------------------------------------------------------------------- KL
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # p = 0.5, p_ref = 0.25: log r = ln 0.5 = -0.693147 ; p = 0.25, p_ref = 0.5: log r = +0.693147
        ("k1", [0.693147, -0.693147]),  # -log r
        ("k2", [0.240227, 0.240227]),  # (log r)^2 / 2
        ("k3", [0.193147, 0.306853]),  # r - 1 - log r: 0.5-1+0.693147 ; 2-1-0.693147
    ],
)
def test_kl_estimators(name, expected):
    logp = torch.log(T([0.5, 0.25]))
    ref = torch.log(T([0.25, 0.5]))
    close(KL_ESTIMATORS.get(name)(logp, ref), expected)


def test_kl_as_reward_penalty():
    # token_rewards [0, 1] - 0.1 * k1; k1 = [0.693147, -0.693147] on trained tokens only
    logp = torch.log(T([[0.5, 0.25, 0.5]]))
    ref = torch.log(T([[0.25, 0.5, 0.1]]))
    mask = T([[1.0, 1.0, 0.0]])
    out = kl_penalty(T([[0.0, 1.0, 0.0]]), logp, ref, mask, kl_coef=0.1, estimator="k1")
    close(out, [[-0.0693147, 1.0693147, 0.0]])
    close(kl_penalty(None, logp, ref, mask, kl_coef=1.0, estimator="k2"), [[-0.240227, -0.240227, 0.0]])


# ----------------------------------------------------------------------------- aggregation
VALUES = T([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("name", "expected", "expected_global"),
    [
        ("token-mean", 10 / 4, 10 / 8),  # (1+2+3+4)/4 ; with num_tokens=8
        ("seq-mean-token-sum", (6 + 4) / 2, 10 / 4),  # row sums 6, 4 ; with num_seqs=4
        ("seq-mean-token-mean", (2 + 4) / 2, (2 + 4) / 4),  # row means 2, 4 ; with num_seqs=4
    ],
)
def test_loss_aggregations(name, expected, expected_global):
    agg = LOSS_AGGREGATIONS.get(name)
    assert float(agg(VALUES, MASK)) == pytest.approx(expected)
    assert float(agg(VALUES, MASK, num_tokens=8, num_seqs=4)) == pytest.approx(expected_global)
    # micro-batches with the whole batch's normalisers sum to the full-batch value
    norms = {"num_tokens": 4, "num_seqs": 2}
    split = agg(VALUES[:1], MASK[:1], **norms) + agg(VALUES[1:], MASK[1:], **norms)
    assert float(split) == pytest.approx(expected)


# ----------------------------------------------------------------------------- importance, staleness
def test_truncated_importance_weights():
    # ratios exp(old - behaviour) = [1, 3, 0.5] ; cap 2 -> weights [1, 2, 0.5]; masked 4th token weight 0
    old = torch.log(T([[1.0, 3.0], [0.5, 7.0]]))
    behaviour = torch.zeros(2, 2)
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    w = truncated_importance_weights(old, behaviour, mask, cap=2.0)
    close(w.weights, [[1.0, 2.0], [0.5, 0.0]])
    assert (w.ratio_mean, w.ratio_min, w.ratio_max) == pytest.approx((1.5, 0.5, 3.0))
    assert w.truncated_fraction == pytest.approx(1 / 3)
    only_row1 = truncated_importance_weights(old, behaviour, mask, cap=2.0, rows=T([False, True]))
    close(only_row1.weights, [[1.0, 1.0], [0.5, 0.0]])
    assert only_row1.ratio_max == pytest.approx(0.5)


def _versions(*versions):
    return [SimpleNamespace(model_version=v, name=f"e{i}") for i, v in enumerate(versions)]


def test_staleness_drop_and_correct():
    exps = _versions(5, 3, 2, 4)  # current 5, max_staleness 2: stale iff version < 3 -> only the 2
    dropped = apply_staleness(exps, current_version=5, max_staleness=2, policy="drop")
    assert [e.model_version for e in dropped.kept] == [5, 3, 4]
    assert (dropped.dropped, dropped.stale, dropped.max_lag) == (1, 1, 3)
    corrected = apply_staleness(exps, current_version=5, max_staleness=2, policy=StalenessPolicy.IMPORTANCE_WEIGHT)
    assert [e.model_version for e in corrected.kept] == [5, 3, 2, 4]
    assert corrected.needs_correction == [False, False, True, False]
    assert (corrected.dropped, corrected.stale) == (0, 1)
    with pytest.raises(ValueError):
        apply_staleness(exps, 5, 1, policy="ignore")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="grpo"):
        ADVANTAGES.get("gpro")


def test_a_plugin_is_found_by_entry_point_and_loaded_on_first_use(monkeypatch):
    from importlib.metadata import EntryPoint

    from streamrft.engines.algorithms import registry

    table = Registry("advantage estimator", group="streamrft.advantages")
    plugin = EntryPoint("plugged", "streamrft.engines.algorithms.advantages:rloo", "streamrft.advantages")
    monkeypatch.setattr(registry, "entry_points",
                        lambda group, name=None: [ep for ep in (plugin,) if ep.group == group and name in (None, ep.name)])
    assert "plugged" in table and table.names() == ["plugged"]
    assert table.get("plugged") is rloo
    with pytest.raises(KeyError, match="known: plugged .*'streamrft.advantages'"):
        table.get("missing")


def test_every_registry_entry_has_a_hand_computed_test():
    assert COVERED["advantage"] == set(ADVANTAGES.names())
    assert COVERED["loss"] == set(POLICY_LOSSES.names())
    assert COVERED["kl"] == set(KL_ESTIMATORS.names())
    assert COVERED["agg"] == set(LOSS_AGGREGATIONS.names())
