"""PPO with a critic: GAE against the paper's formula worked out by hand, the clipped value loss, and the whole
training step on a tiny model (the critic learns, warms up alone, resumes exactly, trains LoRA adapters where the
policy does, and can be a smaller model)."""
from __future__ import annotations

import copy

import pytest
import torch

from streamrft.engines.algorithms import ADVANTAGES, clipped_value_loss, gae_advantages_and_returns, masked_whiten
from streamrft.engines.algorithms.gae import step_rewards
from streamrft.engines.lora import LoraSettings
from streamrft.engines.models import build_tiny_model
from streamrft.engines.training import TrainingEngine, TrainingSettings

from .test_training_engine import EXPS, make_exp, sample, tiny_llama

GAMMA, LAM = 0.9, 0.8  # γλ = 0.72

# three samples of a 3-token response window: all trained; an environment token (mask 0) between two trained
# ones, a dense reward on the first; a 1-token response (then padding)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
REWARDS = torch.tensor([1.0, 2.0, 0.0])
TOKEN_REWARDS = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
VALUES = torch.tensor([[0.5, 0.2, 0.4], [0.3, 9.9, 0.7], [0.25, 9.9, 9.9]])  # 9.9: untrained, must not count

# Schulman et al. 2016 eq. 16, Â_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} − V_t (V after the last token: 0)
# row 0: r = (0, 0, 1); δ = (0.9·0.2 − 0.5, 0.9·0.4 − 0.2, 1 − 0.4) = (−0.32, 0.16, 0.6)
#        Â_2 = 0.6, Â_1 = 0.16 + 0.72·0.6 = 0.592, Â_0 = −0.32 + 0.72·0.16 + 0.72²·0.6 = 0.10624
# row 1: the environment token is skipped: δ_2 = 2 − 0.7 = 1.3, δ_0 = 0.5 + 0.9·0.7 − 0.3 = 0.83
#        Â_2 = 1.3, Â_0 = 0.83 + 0.72·1.3 = 1.766
# row 2: δ_0 = 0 − 0.25; Â_0 = −0.25
EXPECTED_ADVANTAGES = [[0.10624, 0.592, 0.6], [1.766, 0.0, 1.3], [-0.25, 0.0, 0.0]]
# returns R_t = Â_t + V_t on trained tokens
EXPECTED_RETURNS = [[0.60624, 0.792, 1.0], [2.066, 0.0, 2.0], [0.0, 0.0, 0.0]]


def test_gae_matches_the_papers_sum_worked_out_by_hand():
    r = step_rewards(REWARDS, MASK, TOKEN_REWARDS)
    assert r.tolist() == [[0.0, 0.0, 1.0], [0.5, 0.0, 2.0], [0.0, 0.0, 0.0]]  # outcome on the last trained token
    advantages, returns = gae_advantages_and_returns(r, VALUES, MASK, gamma=GAMMA, lam=LAM)
    torch.testing.assert_close(advantages, torch.tensor(EXPECTED_ADVANTAGES))
    torch.testing.assert_close(returns, torch.tensor(EXPECTED_RETURNS))


def test_gae_advantage_is_whitened_over_the_trained_tokens():
    got = ADVANTAGES.get("gae")(REWARDS, MASK, ["a", "b", "c"], token_rewards=TOKEN_REWARDS, values=VALUES,
                                gamma=GAMMA, lam=LAM)
    trained = torch.tensor([a for row, m in zip(EXPECTED_ADVANTAGES, MASK.tolist()) for a, k in zip(row, m) if k])
    whitened = (trained - trained.mean()) / trained.std()  # unbiased std, as veRL's masked_whiten
    torch.testing.assert_close(got[MASK > 0], whitened, rtol=1e-5, atol=1e-5)
    assert (got[MASK == 0] == 0).all()
    assert masked_whiten(torch.tensor([[3.0, 1.0]]), torch.tensor([[1.0, 0.0]])).tolist() == [[0.0, 0.0]]


def test_gae_with_lambda_one_and_no_discount_is_the_return_minus_the_value():
    """γ = λ = 1: the δs telescope, Â_t = Σ_{t' ≥ t} r_t' − V_t (the Monte Carlo advantage)."""
    r = step_rewards(REWARDS, MASK, TOKEN_REWARDS)
    advantages, returns = gae_advantages_and_returns(r, VALUES, MASK, gamma=1.0, lam=1.0)
    assert advantages[0].tolist() == pytest.approx([1 - 0.5, 1 - 0.2, 1 - 0.4])
    assert advantages[1].tolist() == pytest.approx([2.5 - 0.3, 0.0, 2.0 - 0.7])
    torch.testing.assert_close(returns[:2], torch.tensor([[1.0, 1.0, 1.0], [2.5, 0.0, 2.0]]))


def test_value_clipping_bounds_the_step_pessimistically():
    """``½·max((V − R)², (clip(V, V_old ± ε) − R)²)``, ε = 0.2, worked out by hand."""
    values = torch.tensor([[1.0, 0.0, 0.5, 3.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    returns = torch.tensor([[2.0, -1.0, 0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # t0: V moved 1.0 toward R = 2: clipped to 0.2, (0.2 − 2)² = 3.24 > (1 − 2)² = 1 -> 1.62, no gradient
    # t1: V did not move: both terms (0 + 1)² = 1 -> 0.5
    # t2: V moved past R = 0.3 to 0.5: (0.5 − 0.3)² = 0.04 > (0.2 − 0.3)² = 0.01 -> 0.02, pulled back
    # t3: not trained
    assert out.token_loss.tolist()[0] == pytest.approx([1.62, 0.5, 0.02, 0.0])
    assert out.clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    out.token_loss.sum().backward()
    assert values.grad.tolist()[0] == pytest.approx([0.0, 1.0, 0.2, 0.0])  # d/dV ½(V − R)² = V − R
    plain = clipped_value_loss(values, old, returns, mask, cliprange_value=None)
    assert plain.token_loss.tolist()[0] == pytest.approx([0.5, 0.5, 0.02, 0.0]) and not plain.clipped.any()


# ----------------------------------------------------------------------------- the training step
PPO = dict(advantage="gae", lr=1e-3, micro_batch_size=2, gae_lambda=0.95, critic={"lr": 1e-3})


def test_a_ppo_step_trains_the_policy_and_its_own_critic(tiny_model_dir):
    engine = TrainingEngine.from_pretrained(tiny_model_dir, TrainingSettings(**PPO), device="cpu")
    critic = engine.critic.model
    policy_params = {p.data_ptr() for p in engine.model.parameters()}
    assert not policy_params & {p.data_ptr() for p in critic.parameters()}  # a copy, not the policy's weights
    assert critic.value_head.in_features == engine.model.config.hidden_size
    policy_before = copy.deepcopy(engine.model.state_dict())
    critic_before = copy.deepcopy(critic.state_dict())
    losses = []
    for _ in range(6):
        metrics = engine.train_step(EXPS)
        losses.append(metrics["critic/vf_loss"])
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/value_explained_var",
                "critic/grad_norm", "actor/pg_loss"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["critic/lr"] == pytest.approx(1e-3) and engine.critic.step == engine.step == 6
    assert losses[-1] < 0.5 * losses[0], losses  # the same batch six times: the critic fits its returns
    assert metrics["critic/value_explained_var"] > 0.2
    assert any(not torch.equal(t, critic.state_dict()[n]) for n, t in critic_before.items() if "backbone" in n)
    assert any(not torch.equal(t, engine.model.state_dict()[n]) for n, t in policy_before.items())


def test_during_the_critic_warmup_the_policy_does_not_move():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(**PPO | {"critic": {"lr": 1e-3, "critic_warmup": 2}}),
                            device="cpu")
    before = copy.deepcopy(engine.model.state_dict())
    for _ in range(2):
        metrics = engine.train_step(EXPS)
        assert metrics["critic/warmup"] == 1.0 and "actor/pg_loss" not in metrics
    assert engine.step == 0 and engine.critic.step == 2
    assert all(torch.equal(t, engine.model.state_dict()[n]) for n, t in before.items())
    metrics = engine.train_step(EXPS)
    assert "critic/warmup" not in metrics and "actor/pg_loss" in metrics and engine.step == 1
    assert any(not torch.equal(t, engine.model.state_dict()[n]) for n, t in before.items())


def test_a_resumed_critic_continues_exactly(tmp_path):
    """Two steps, a checkpoint, a fresh engine (other initial weights) restored from it: its next step's values,
    losses and weights are the uninterrupted engine's."""
    settings = TrainingSettings(**PPO | {"critic": {"lr": 1e-3, "lr_schedule": "warmup_cosine", "warmup_steps": 2,
                                                    "total_steps": 10}})
    engine = TrainingEngine(tiny_llama(), settings, device="cpu")
    for _ in range(2):
        engine.train_step(EXPS)
    engine.save_state(tmp_path)
    resumed = TrainingEngine(tiny_llama(seed=1), settings, device="cpu")
    resumed.load_state(tmp_path)
    assert resumed.critic.step == 2
    want, got = engine.train_step(EXPS), resumed.train_step(EXPS)
    for key in ("critic/values_mean", "critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                "actor/loss", "actor/advantage_abs_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    for (name, a), b in zip(engine.critic.model.state_dict().items(), resumed.critic.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_critic_trains_lora_adapters_where_the_policy_does(tmp_path):
    lora = LoraSettings(rank=4, alpha=8.0)
    engine = TrainingEngine(tiny_llama(), TrainingSettings(**PPO), device="cpu", lora=lora)
    trained = {n for n, p in engine.critic.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.startswith("value_head.") for n in trained)
    assert {"value_head.weight", "value_head.bias"} <= trained
    frozen = {n: p.detach().clone() for n, p in engine.critic.model.named_parameters() if not p.requires_grad}
    engine.train_step(EXPS)
    assert all(torch.equal(p, frozen[n]) for n, p in engine.critic.model.named_parameters() if n in frozen)
    state = engine.state_dict()["critic"]["model"]
    assert set(state) == trained  # the checkpoint keeps the adapters and the head, not the frozen base
    engine.save_state(tmp_path)
    resumed = TrainingEngine(tiny_llama(), TrainingSettings(**PPO), device="cpu", lora=lora)
    resumed.load_state(tmp_path)
    want, got = engine.train_step(EXPS), resumed.train_step(EXPS)
    assert got["critic/vf_loss"] == pytest.approx(want["critic/vf_loss"], rel=1e-6)


def test_a_smaller_model_can_be_the_critic(tmp_path, tiny_model_dir):
    small = build_tiny_model(tmp_path / "small", seed=5, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    settings = TrainingSettings(**PPO | {"critic": {"model_path": str(small)}})
    engine = TrainingEngine.from_pretrained(tiny_model_dir, settings, device="cpu")
    assert engine.critic.model.value_head.in_features == 32 != engine.model.config.hidden_size
    assert len(engine.critic.model.backbone.layers) == 1
    metrics = engine.train_step(EXPS)
    assert torch.isfinite(torch.tensor(metrics["critic/vf_loss"])) and engine.critic.step == 1
    with pytest.raises(FileNotFoundError, match="trainer.critic.model_path"):
        TrainingEngine.from_pretrained(tiny_model_dir, TrainingSettings(
            **PPO | {"critic": {"model_path": str(tmp_path / "none")}}), device="cpu")


@pytest.mark.model
def test_ppo_with_a_critic_raises_a_synthetic_reward():
    """As GRPO's test in test_training_engine: reward 1 when the first response token is TARGET. No groups: the
    critic is the baseline (each experience its own group)."""
    target, prompt = 5, [1, 2, 3]
    torch.manual_seed(0)
    engine = TrainingEngine(tiny_llama(seed=3), TrainingSettings(
        advantage="gae", lr=1e-2, micro_batch_size=16, critic={"lr": 1e-2}), device="cpu")

    def p_target() -> float:
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        return float(torch.softmax(logits, -1)[target])

    before, rewards = p_target(), []
    for step in range(12):
        resp, logp = sample(engine.model, prompt, n=32, length=2)
        exps = []
        for i in range(32):
            rewards.append(float(resp[i, 0] == target))
            exps.append(make_exp(prompt + resp[i].tolist(), len(prompt), rewards[-1], f"s{step}-{i}",
                                 logp[i].tolist()))
        engine.train_step(exps)
    after = p_target()
    assert before < 0.1 and after > 0.5, (before, after)  # measured: 0.05 -> 0.90
    assert sum(rewards[-64:]) > sum(rewards[:64])  # measured: 5 -> 41 of 64


# ----------------------------------------------------------------------------- settings
def test_critic_settings_are_checked_at_load():
    from streamrft.config import load_config
    from streamrft.errors import ConfigError

    config = load_config(overrides={"trainer": {"total_steps": 40, "critic": {"lr": 3e-6, "lr_schedule":
                                                                              "warmup_cosine"},
                                                "algorithm": {"advantage": "gae", "gae_lambda": 0.95}}}, env={})
    settings = config.training_settings
    assert settings.uses_critic and settings.advantage_kwargs == {"gamma": 1.0, "lam": 0.95}
    assert settings.critic.lr == 3e-6 and settings.critic_schedule.total_steps == 40  # the trainer's horizon
    with pytest.raises(ConfigError, match="trainer.critic configures the value model of advantage gae"):
        load_config(overrides={"trainer": {"critic": {"lr": 3e-6}}}, env={})
    with pytest.raises(ConfigError, match="gae_gamma and gae_lambda"):
        load_config(overrides={"trainer": {"algorithm": {"advantage": "gae", "advantage_params": {"lam": 0.9}}}},
                    env={})
    with pytest.raises(ConfigError, match="trainer.critic.lr_schedule=warmup_cosine needs"):
        load_config(overrides={"trainer": {"critic": {"lr_schedule": "warmup_cosine"},
                                           "algorithm": {"advantage": "gae"}}}, env={})
