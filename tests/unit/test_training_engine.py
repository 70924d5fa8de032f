"""Training engine on a tiny Llama: batch layout and masks, logprobs, gradient accumulation, clipping, the lr
schedule, checkpoint state, and a few GRPO steps that must raise a synthetic reward."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from streamrft.engines.training import TrainingEngine, TrainingSettings, collate, lr_factor
from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32, pack_u8

VOCAB = 16


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def make_exp(tokens, prompt_length, reward=0.0, group="g", logprobs=None, action_mask=None, token_rewards=None,
             version=0, eid="e"):
    n = len(tokens) - prompt_length
    return Experience(
        eid=eid, group_id=group, task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0,
        model_version=version, tokens=pack_i32(tokens), prompt_length=prompt_length,
        logprobs=pack_f32(logprobs if logprobs is not None else [-1.0] * n), reward=reward,
        action_mask=None if action_mask is None else pack_u8(action_mask),
        token_rewards=None if token_rewards is None else pack_f32(token_rewards),
    )


EXPS = [
    make_exp([1, 2, 3, 4, 5], 3, reward=1.0, group="a"),
    make_exp([1, 2, 3, 6], 3, reward=0.0, group="a"),
    make_exp([7, 8, 9, 10, 11, 12], 2, reward=0.5, group="b", action_mask=[1, 0, 1, 1]),
    make_exp([7, 8, 1], 2, reward=0.0, group="b", token_rewards=[0.25]),
]


# ----------------------------------------------------------------------------- collate (no model)
def test_collate_left_pads_prompts_right_pads_responses():
    b = collate(EXPS, pad_token_id=0)
    assert b.prompt_width == 3 and b.response_width == 4
    assert b.input_ids.tolist() == [
        [1, 2, 3, 4, 5, 0, 0],
        [1, 2, 3, 6, 0, 0, 0],
        [0, 7, 8, 9, 10, 11, 12],
        [0, 7, 8, 1, 0, 0, 0],
    ]
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 0, 0, 0],
    ]
    assert b.position_ids[2].tolist() == [0, 0, 1, 2, 3, 4, 5]  # counts from the first real token
    # response mask = real response token AND action mask
    assert b.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0]]
    assert b.behaviour_logprobs[2].tolist() == [-1.0, -1.0, -1.0, -1.0]
    assert b.behaviour_logprobs[1].tolist() == [-1.0, 0.0, 0.0, 0.0]
    assert b.token_rewards[3].tolist() == [0.25, 0.0, 0.0, 0.0] and b.token_rewards[0].sum() == 0
    assert b.group_ids == ["a", "a", "b", "b"]
    assert b.rewards.tolist() == [1.0, 0.0, 0.5, 0.0]


def test_select_trims_padding_columns():
    sub = collate(EXPS).select([1, 3])
    assert sub.input_ids.tolist() == [[1, 2, 3, 6], [0, 7, 8, 1]]
    assert sub.response_width == 1 and sub.prompt_width == 3


def test_micro_batches_go_shortest_first_each_trimmed_to_its_own_widths():
    """Sampled responses vary in length: sorted micro-batches carry less padding than rows in arrival order."""
    from streamrft.engines.training.parallel import SingleProcess

    exps = [make_exp(list(range(1, 3 + n)), 2, eid=f"e{n}") for n in (9, 1, 7, 2, 8, 1)]
    batch = collate(exps, pad_token_id=0)
    micro = list(SingleProcess().micro_batches(batch, 2))
    assert [m.rows for m in micro] == [[1, 5], [3, 2], [4, 0]]  # by length, stable
    assert [m.batch.response_width for m in micro] == [1, 7, 9]
    padded = sum(len(m.batch) * m.batch.input_ids.shape[1] for m in micro)
    in_order = sum(len(b) * b.input_ids.shape[1] for b in batch.micro_batches(2))
    assert (padded, in_order) == (46, 60)  # token positions of work, padding included


def test_collate_refuses_misaligned_logprobs():
    bad = make_exp([1, 2, 3, 4], 2, logprobs=[-1.0], eid="bad-one")
    with pytest.raises(ValueError, match="bad-one.*logprobs has 1 entries but the response has 2"):
        collate([bad])


def test_lr_schedule_warmup_cosine_hand_values():
    s = TrainingSettings(lr=1.0, lr_schedule="warmup_cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # warm-up (step+1)/2; then 0.1 + 0.9 * (1 + cos(pi * (step-2)/4)) / 2
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55,
                0.1 + 0.9 * (1 - math.cos(math.pi / 4)) / 2, 0.1, 0.1]
    assert [lr_factor(i, s) for i in range(8)] == pytest.approx(expected)
    assert [lr_factor(i, TrainingSettings(warmup_steps=4)) for i in (0, 3, 9)] == [0.25, 1.0, 1.0]


def test_settings_explain_bad_values():
    with pytest.raises(ValueError, match="total_steps"):
        TrainingSettings(lr_schedule="warmup_cosine", warmup_steps=10, total_steps=5)
    with pytest.raises(ValueError, match="no advantage estimator is registered as 'gpro'; known: distill, dr_grpo"):
        TrainingSettings(advantage="gpro")
    with pytest.raises(ValueError, match="lr_shedule"):  # a misspelt knob is no silent default
        TrainingSettings(lr_shedule="warmup_cosine")


# ----------------------------------------------------------------------------- with a tiny model
def reference_logprobs(model, exp: Experience) -> torch.Tensor:
    """Unpadded, one sequence at a time: log p(token_t | tokens_<t) for the response tokens."""
    ids = torch.from_numpy(exp.token_array.astype("int64"))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[exp.prompt_length - 1 :]


@pytest.mark.model
def test_padded_batch_logprobs_match_unpadded_sequences():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(micro_batch_size=3), device="cpu")
    batch = engine.collate(EXPS)
    logp = engine.compute_logprobs(batch)
    for i, exp in enumerate(EXPS):
        expected = reference_logprobs(engine.model, exp) * batch.response_mask[i, : exp.response_length]
        torch.testing.assert_close(logp[i, : exp.response_length], expected, atol=1e-5, rtol=0)
        assert (logp[i, exp.response_length :] == 0).all()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.model
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_accumulation_equals_one_batch(agg):
    model = tiny_llama()
    # the ratio is taken against the rollout's logprobs (-1.0, far from the policy's), so clipping is exercised
    settings = dict(lr=1e-3, loss_agg=agg, entropy_coef=0.01, clip_low=0.1, clip_high=0.1,
                    recompute_old_logprobs=False, kl_coef=0.05)
    whole = TrainingEngine(model, TrainingSettings(micro_batch_size=4, **settings), device="cpu")
    split = TrainingEngine(copy.deepcopy(model), TrainingSettings(micro_batch_size=1, **settings), device="cpu")
    batch_w = whole.prepare(EXPS)
    batch_s = split.prepare(EXPS)
    mw, ms = whole.backward(batch_w), split.backward(batch_s)
    assert 0 < mw["actor/pg_clipfrac"] < 1
    for key in ("actor/loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/entropy", "actor/kl_loss"):
        assert mw[key] == pytest.approx(ms[key], abs=1e-6), key
    gw, gs = grads(whole.model), grads(split.model)
    assert gw and gw.keys() == gs.keys()
    for name in gw:
        torch.testing.assert_close(gw[name], gs[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.model
def test_gradient_clipping_reports_the_raw_norm_and_clips():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, max_grad_norm=1e-3), device="cpu")
    engine.backward(engine.prepare(EXPS))
    raw = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads(engine.model).values()]))
    metrics = engine.apply_gradients()
    assert metrics["actor/grad_norm"] == pytest.approx(float(raw), rel=1e-5) and raw > 1e-2
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads(engine.model).values()]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)
    assert engine.step == 1


@pytest.mark.model
def test_lr_follows_the_schedule_through_steps():
    s = TrainingSettings(lr=0.01, lr_schedule="warmup_cosine", warmup_steps=2, total_steps=4)
    engine = TrainingEngine(tiny_llama(), s, device="cpu")
    lrs = [engine.train_step(EXPS)["actor/lr"] for _ in range(4)]
    assert lrs == pytest.approx([0.005, 0.01, 0.01, 0.005])


@pytest.mark.model
def test_state_dict_round_trip_resumes_identically():
    s = TrainingSettings(lr=1e-2, lr_schedule="warmup_cosine", warmup_steps=1, total_steps=10)
    a = TrainingEngine(tiny_llama(seed=1), s, device="cpu")
    a.train_step(EXPS)
    a.train_step(EXPS)
    state = copy.deepcopy(a.state_dict())
    b = TrainingEngine(tiny_llama(seed=2), s, device="cpu")  # different init: everything must come from state
    b.load_state_dict(state)
    assert b.step == 2 and b.lr == pytest.approx(a.lr)
    ma, mb = a.train_step(EXPS), b.train_step(EXPS)
    assert ma["actor/lr"] == mb["actor/lr"]
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=n)


@pytest.mark.model
def test_bf16_autocast_step_runs_on_cpu():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, mixed_precision="bf16"), device="cpu")
    assert engine.autocast_dtype == torch.bfloat16
    metrics = engine.train_step(EXPS)
    assert math.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # fp32 master weights


@pytest.mark.model
def test_named_weights_yields_tied_tensors_once():
    engine = TrainingEngine(tiny_llama(), device="cpu")
    names = [n for n, _ in engine.named_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    assert all(t.dtype == torch.bfloat16 for _, t in engine.named_weights(dtype=torch.bfloat16))


@pytest.mark.model
def test_stale_experiences_get_truncated_importance_weights():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(tis_cap=2.0), device="cpu")
    current = engine.compute_logprobs(engine.collate(EXPS[:2]))
    # behaviour = current − ln 3 on row 0 (ratio 3, truncated to 2), = current + ln 2 on row 1 (ratio 0.5)
    exps = [
        make_exp([1, 2, 3, 4, 5], 3, 1.0, "a", logprobs=(current[0, :2] - math.log(3)).tolist(), version=0),
        make_exp([1, 2, 3, 6], 3, 0.0, "a", logprobs=(current[1, :1] + math.log(2)).tolist(), version=0),
    ]
    batch = engine.prepare(exps, needs_correction=[True, False])
    torch.testing.assert_close(batch.loss_weights, torch.tensor([[2.0, 2.0], [1.0, 0.0]]), atol=1e-4, rtol=0)
    assert batch.metrics["actor/num_corrected"] == 1
    assert batch.metrics["actor/is_ratio_max"] == pytest.approx(3.0, rel=1e-4)
    assert batch.metrics["actor/is_ratio_min"] == pytest.approx(0.5, rel=1e-4)
    metrics = engine.optimizer_step(batch)
    assert math.isfinite(metrics["actor/pg_loss"])


@pytest.mark.model
def test_decoupled_ppo_reweights_every_row_by_its_behaviour_policy():
    """With policy_loss decoupled_ppo the behaviour weights go on fresh rows too (not only stale ones), and
    the proximal logprobs are the trainer's own (recomputed)."""
    engine = TrainingEngine(tiny_llama(), TrainingSettings(policy_loss="decoupled_ppo", tis_cap=4.0), device="cpu")
    current = engine.compute_logprobs(engine.collate(EXPS[:2]))
    exps = [
        make_exp([1, 2, 3, 4, 5], 3, 1.0, "a", logprobs=(current[0, :2] - math.log(3)).tolist(), version=0),
        make_exp([1, 2, 3, 6], 3, 0.0, "a", logprobs=(current[1, :1] + math.log(2)).tolist(), version=0),
    ]
    batch = engine.prepare(exps, needs_correction=[False, False])
    torch.testing.assert_close(batch.old_logprobs, current, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch.loss_weights, torch.tensor([[3.0, 3.0], [0.5, 0.0]]), atol=1e-4, rtol=0)
    assert math.isfinite(engine.optimizer_step(batch)["actor/pg_loss"])
    with pytest.raises(ValueError, match="recompute_old_logprobs"):
        TrainingSettings(policy_loss="decoupled_ppo", recompute_old_logprobs=False)


@pytest.mark.model
def test_kl_loss_uses_a_frozen_copy_as_reference():
    engine = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-2, kl_coef=0.1, kl_penalty_coef=0.05), device="cpu")
    assert engine.ref_model is not None and not any(p.requires_grad for p in engine.ref_model.parameters())
    first = engine.train_step(EXPS)
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    later = engine.train_step(EXPS)
    assert later["actor/kl"] > 1e-6 and later["actor/kl_penalty"] > 1e-6


def sample(model, prompt: list[int], n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sampled responses (ids and behaviour logprobs) of ``length`` tokens each."""
    ids = torch.tensor([prompt] * n)
    logps = []
    with torch.no_grad():
        for _ in range(length):
            logits = model(input_ids=ids).logits[:, -1].float()
            dist = torch.distributions.Categorical(logits=logits)
            nxt = dist.sample()
            logps.append(dist.log_prob(nxt))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids[:, len(prompt) :], torch.stack(logps, 1)


@pytest.mark.model
def test_grpo_raises_a_synthetic_reward():
    """Reward 1 when the first response token is TARGET: its probability must rise within a few steps."""
    target, prompt = 5, [1, 2, 3]
    torch.manual_seed(0)
    engine = TrainingEngine(
        tiny_llama(seed=3),
        TrainingSettings(lr=1e-2, advantage="grpo", clip_low=0.2, clip_high=0.28, micro_batch_size=16),
        device="cpu",
    )

    def p_target() -> float:
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        return float(torch.softmax(logits, -1)[target])

    before = p_target()
    rewards = []
    for step in range(15):
        exps = []
        for g in range(4):
            resp, logp = sample(engine.model, prompt, n=8, length=2)
            for i in range(8):
                r = float(resp[i, 0] == target)
                exps.append(make_exp(prompt + resp[i].tolist(), len(prompt), r, f"s{step}g{g}", logp[i].tolist()))
                rewards.append(r)
        metrics = engine.train_step(exps)
        assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: old == current
    after = p_target()
    assert before < 0.1 and after > 0.5, (before, after)  # measured: ~0.05 -> ~0.95
    assert sum(rewards[-64:]) > sum(rewards[:64])


@pytest.mark.model
def test_from_pretrained_loads_the_tiny_model_dir(tiny_model_dir):
    engine = TrainingEngine.from_pretrained(tiny_model_dir, TrainingSettings(micro_batch_size=2), device="cpu")
    exps = [make_exp([5, 6, 7, 8], 2, 1.0, "a"), make_exp([5, 6, 9], 2, 0.0, "a")]
    before = {n: t.clone() for n, t in engine.named_weights()}
    metrics = engine.train_step(exps)
    assert engine.step == 1 and math.isfinite(metrics["actor/grad_norm"])
    assert any(not torch.equal(before[n], t) for n, t in engine.named_weights())


def test_entropy_from_logprobs_matches_torch_categorical():
    from streamrft.engines.training import entropy_from_logprobs

    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0)) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logprobs(torch.log_softmax(logits, -1)), expected, atol=1e-5)


# ----------------------------------------------------------------------------- proximal logprobs in the pass
def _mixed_behaviour(engine):
    """EXPS-like rows whose behaviour logprobs sit off the policy's (ratios 3 and 0.5 and 1.5), one row stale."""
    current = engine.compute_logprobs(engine.collate(EXPS[:3]))
    return [
        make_exp([1, 2, 3, 4, 5], 3, 1.0, "a", logprobs=(current[0, :2] - math.log(3)).tolist()),
        make_exp([1, 2, 3, 6], 3, 0.0, "a", logprobs=(current[1, :1] + math.log(2)).tolist()),
        make_exp([7, 8, 9, 10, 11, 12], 2, 0.5, "b", action_mask=[1, 0, 1, 1],
                 logprobs=(current[2, :4] - math.log(1.5)).tolist()),
        make_exp([7, 8, 1], 2, 0.0, "b"),
    ], [True, False, False, True]


def _forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.model
@pytest.mark.parametrize("loss", ["ppo_clip", "decoupled_ppo"])
def test_one_update_takes_its_proximal_logprobs_from_the_training_pass_with_the_same_gradient(loss):
    """A batch that trains one step gets the same gradient, weights and mismatch statistics as with the
    separate no-grad forward, with one forward pass per micro-batch instead of two."""
    settings = TrainingSettings(lr=1e-3, micro_batch_size=2, policy_loss=loss, tis_cap=2.0, entropy_coef=0.01)
    separate = TrainingEngine(tiny_llama(), settings, device="cpu")
    in_pass = TrainingEngine(copy.deepcopy(separate.model), settings, device="cpu")
    exps, stale = _mixed_behaviour(separate)
    forwards = _forwards(in_pass.model)

    reference = separate.prepare(exps, stale)
    batch = in_pass.prepare(exps, stale, one_update=True)
    assert batch.proximal_in_pass and batch.old_logprobs is None and forwards[0] == 0
    expected, got = separate.backward(reference), in_pass.backward(batch)
    assert forwards[0] == 2  # 4 rows in micro-batches of 2: the training forwards alone

    for key in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    for key in ("actor/is_ratio_mean", "actor/is_ratio_min", "actor/is_ratio_max", "actor/is_truncated_frac"):
        assert got[key] == pytest.approx(reference.metrics[key], rel=1e-4), key
    assert got["actor/is_ratio_max"] == pytest.approx(3.0, rel=1e-4)  # the statistics really were computed
    torch.testing.assert_close(batch.old_logprobs, reference.old_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch.loss_weights, reference.loss_weights, atol=1e-4, rtol=0)
    assert not batch.proximal_in_pass  # filled in: a second pass (an epoch) uses them as prepared ones
    gs, gi = grads(separate.model), grads(in_pass.model)
    assert gs and gs.keys() == gi.keys()
    for name in gs:
        torch.testing.assert_close(gi[name], gs[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.model
def test_train_step_computes_the_proximal_logprobs_in_the_pass_unless_something_needs_them_first():
    plain = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, micro_batch_size=4), device="cpu")
    forwards = _forwards(plain.model)
    plain.train_step(EXPS)
    assert forwards[0] == 1

    penalised = TrainingEngine(tiny_llama(), TrainingSettings(lr=1e-3, micro_batch_size=4, kl_penalty_coef=0.05),
                               device="cpu")
    assert not penalised.proximal_in_pass_possible  # the advantages need them before the loss
    assert not penalised.prepare(EXPS, one_update=True).proximal_in_pass

    dropout = tiny_llama()
    dropout.config.attention_dropout = 0.1
    assert not TrainingEngine(dropout, TrainingSettings(), device="cpu").proximal_in_pass_possible
    forwards = _forwards(dropout)
    TrainingEngine(dropout, TrainingSettings(lr=1e-3, micro_batch_size=4), device="cpu").train_step(EXPS)
    assert forwards[0] == 2  # the eval-mode forward, then the training one
