"""SFT and DPO rows without a broker: the losses by hand (value and gradient, through the training engine), the
weighting of a mixed step, pairs kept whole over micro-batches and ranks, masks on the assistant's tokens only,
the rows of chat and preference files and their rejections, the record checks and the config's refusals."""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from streamrft.config import load_config
from streamrft.engines.algorithms import dpo, ipo
from streamrft.engines.models import build_tiny_tokenizer
from streamrft.engines.training import TrainingEngine, TrainingSettings, collate
from streamrft.engines.training.parallel import SingleProcess
from streamrft.engines.training.supervised import pair_micro_batches, pair_order, pair_problem
from streamrft.errors import ConfigError
from streamrft.producers.chat_rows import ChatMapping, Conversation, to_conversation, to_preference
from streamrft.producers.chat_tokens import tokenize_conversation
from streamrft.schemas import Experience, InvalidRecordError, Objective, RolloutKind, pack_f32, pack_i32, pack_u8
from streamrft.validation import check_experience

VOCAB = 16


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def make(tokens, prompt_length, objective=Objective.SFT, group="g", run_index=0, logprobs=None, action_mask=None,
         reward=0.0, group_size=1):
    n = len(tokens) - prompt_length
    return Experience(eid=f"{group}/{run_index}", group_id=group, task_id=group, step=0, kind=RolloutKind.TRAIN,
                      run_index=run_index, group_size=group_size, model_version=0, tokens=pack_i32(tokens),
                      prompt_length=prompt_length, logprobs=pack_f32(logprobs or [0.0] * n), reward=reward,
                      action_mask=None if action_mask is None else pack_u8(action_mask), objective=objective)


def pair(group, prompt, chosen, rejected, ref_chosen, ref_rejected):
    return [make(prompt + chosen, len(prompt), Objective.DPO, group, 0, ref_chosen, group_size=2),
            make(prompt + rejected, len(prompt), Objective.DPO, group, 1, ref_rejected, group_size=2)]


SFT = [make([1, 2, 3, 4, 5, 6, 7], 2, group="s1", action_mask=[1, 1, 0, 0, 1]),  # a second turn: 0s between
       make([3, 9, 8], 2, group="s2")]
DPO = (pair("p1", [5, 6], [7, 8, 9], [10, 11], [-2.5, -2.0, -3.0], [-1.5, -2.5])
       + pair("p2", [4, 3, 2], [12], [13, 14, 15], [-2.0], [-3.0, -2.0, -2.5]))
RL = [make([1, 2, 3, 4], 2, Objective.RL, "a", 0, [-2.0, -2.0], reward=1.0, group_size=2),
      make([1, 2, 5], 2, Objective.RL, "a", 1, [-2.0], reward=0.0, group_size=2)]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def token_logprobs(model, exp: Experience) -> torch.Tensor:
    """The response tokens' logprobs under ``model``, one unpadded sequence at a time: written here, apart from
    the engine's batching."""
    ids = torch.tensor(exp.token_array, dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0, exp.prompt_length - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, exp.prompt_length:, None])[:, 0]


def engine_of(model, **settings) -> TrainingEngine:
    return TrainingEngine(copy.deepcopy(model), TrainingSettings(lr=1e-3, max_grad_norm=None, **settings),
                          device="cpu")


# ---------------------------------------------------------------------------------------------- the losses
def test_dpo_and_ipo_losses_by_hand():
    out = dpo(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5]), torch.tensor([-3.5, -4.0]),
              torch.tensor([-3.5, -5.0]), beta=0.5)
    # pair 1: 0.5·((−3 + 3.5) − (−4 + 3.5)) = 0.5; pair 2: 0.5·((−5 + 4) − (−4.5 + 5)) = −0.75
    assert out.loss.tolist() == pytest.approx([math.log(1 + math.exp(-0.5)), math.log(1 + math.exp(0.75))])
    assert out.chosen_rewards.tolist() == pytest.approx([0.25, -0.5])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.25, 0.25])
    # IPO: (h − 1/(2β))² with h = β-free margin: pair 1: h = 1.0 → (1 − 1)² = 0; pair 2: h = −1.5 → (−1.5 − 1)²
    squared = ipo(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5]), torch.tensor([-3.5, -4.0]),
                  torch.tensor([-3.5, -5.0]), beta=0.5)
    assert squared.loss.tolist() == pytest.approx([0.0, 6.25])
    at_start = dpo(torch.tensor([-2.0]), torch.tensor([-7.0]), torch.tensor([-2.0]), torch.tensor([-7.0]), beta=0.1)
    assert float(at_start.loss) == pytest.approx(math.log(2))  # policy = reference: margin 0


@pytest.mark.parametrize("micro_batch_size", [1, 8])
def test_sft_loss_and_gradient_by_hand(micro_batch_size):
    """L = −(1/T) Σ log π over the T trained tokens (the action mask's 1s), whatever the micro-batches."""
    model = tiny_llama()
    hand = copy.deepcopy(model)
    logps = [token_logprobs(hand, e)[torch.tensor(e.action_mask_array, dtype=torch.bool)] for e in SFT]
    loss = -torch.cat(logps).sum() / sum(len(x) for x in logps)
    loss.backward()
    engine = engine_of(model, micro_batch_size=micro_batch_size)
    metrics = engine.train_step(SFT)
    assert metrics["sft/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["sft/num_tokens"] == 4 and metrics["sft/num_sequences"] == 2
    for name, g in grads(hand).items():
        torch.testing.assert_close(grads(engine.model)[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("micro_batch_size", [2, 8])  # 2: a micro-batch per pair
def test_dpo_loss_and_gradient_by_hand_against_the_records_reference(micro_batch_size):
    beta = 0.2
    model = tiny_llama()
    hand = copy.deepcopy(model)
    losses, margins = [], []
    for chosen, rejected in (DPO[0:2], DPO[2:4]):
        z = [token_logprobs(hand, side).sum() - float(side.logprob_array.sum()) for side in (chosen, rejected)]
        margins.append(beta * (z[0] - z[1]).item())
        losses.append(-torch.log(torch.sigmoid(beta * (z[0] - z[1]))))
    loss = sum(losses) / 2
    loss.backward()
    engine = engine_of(model, micro_batch_size=micro_batch_size, dpo_beta=beta)
    metrics = engine.train_step(DPO[::-1])  # any order: the engine pairs them by group and run_index
    assert metrics["dpo/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["dpo/reward_margin"] == pytest.approx(sum(margins) / 2, rel=1e-4)
    assert metrics["dpo/accuracy"] == sum(m > 0 for m in margins) / 2 and metrics["dpo/num_pairs"] == 2
    for name, g in grads(hand).items():
        torch.testing.assert_close(grads(engine.model)[name], g, rtol=1e-4, atol=1e-6)


def test_a_mixed_step_weights_each_objective_by_its_share_and_keeps_data_out_of_the_advantages():
    """Gradient of RL + SFT + DPO rows = Σ (rows_o / rows)·gradient of each alone; the RL rows' advantages and
    batch metrics are those of the RL rows alone (no SFT row in a GRPO group)."""
    model = tiny_llama()
    alone = {}
    for name, rows in (("rl", RL), ("sft", SFT), ("dpo", DPO)):
        engine = engine_of(model, recompute_old_logprobs=True)
        alone[name] = (engine.train_step(rows), grads(engine.model))
    mixed = engine_of(model, recompute_old_logprobs=True)
    metrics = mixed.train_step(SFT + RL + DPO)
    shares = {"rl": 2 / 8, "sft": 2 / 8, "dpo": 4 / 8}
    assert {k: metrics[f"mix/{k}_share"] for k in shares} == shares
    for name, g in grads(mixed.model).items():
        expected = sum(share * alone[k][1][name] for k, share in shares.items())
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6)
    for key in ("actor/advantage_abs_mean", "actor/num_sequences", "actor/num_tokens", "actor/reward_mean",
                "actor/loss"):
        assert metrics[key] == pytest.approx(alone["rl"][0][key], rel=1e-5), key
    assert metrics["sft/loss"] == pytest.approx(alone["sft"][0]["sft/loss"], rel=1e-5)
    assert metrics["dpo/loss"] == pytest.approx(alone["dpo"][0]["dpo/loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------- pairs
def test_pairs_are_put_in_order_and_bad_pairs_named():
    assert [(e.group_id, e.run_index) for e in pair_order(DPO[::-1])] == [("p2", 0), ("p2", 1), ("p1", 0), ("p1", 1)]
    two_chosen = [DPO[0], replace(make([5, 6, 10, 11], 2, Objective.DPO, "p1", 0, group_size=2), eid="p1/other")]
    assert "run_index 0 (chosen) and 1 (rejected)" in pair_problem(two_chosen)
    other_prompt = [DPO[0], make([9, 9, 10, 11], 2, Objective.DPO, "p1", 1, group_size=2)]
    assert pair_problem(other_prompt) == "the chosen and the rejected response follow different prompts"
    assert "has 1" in pair_problem(DPO[:1])
    with pytest.raises(ValueError, match="DPO group 'p1'"):
        pair_order(other_prompt)


class _Rank(SingleProcess):
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def test_pair_micro_batches_keep_pairs_whole_over_micro_batches_and_ranks():
    pairs = pair_order(DPO + pair("p3", [1], [2], [3], [-1.0], [-1.0]))  # 3 pairs, 6 rows
    batch = collate(pairs)
    seen = []
    for rank in (0, 1):
        micro = list(pair_micro_batches(_Rank(rank, 2), batch, size=2))
        assert len(micro) == 2  # ceil(3 pairs / 2 ranks) = 2 pairs each at most, one pair a micro-batch
        for mb in micro:
            assert len(mb.rows) % 2 == 0 and all(mb.rows[i] + 1 == mb.rows[i + 1] and mb.rows[i] % 2 == 0
                                                 for i in range(0, len(mb.rows), 2))
            seen += mb.rows
        assert sum(mb.padding for mb in micro) == (1 if rank == 1 else 0)  # rank 1 has one pair: a padding one
    assert sorted(seen) == list(range(6))


# ----------------------------------------------------------------------------------------------- chat masks
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok!"}]


def _split(tokenizer, tokens):
    response = tokens.response_ids
    trained = tokenizer.decode([t for t, m in zip(response, tokens.action_mask) if m], skip_special_tokens=False)
    untrained = tokenizer.decode([t for t, m in zip(response, tokens.action_mask) if not m],
                                 skip_special_tokens=False)
    return trained, untrained


def test_the_mask_is_on_the_assistants_tokens_and_end_of_turn_only():
    tokenizer = build_tiny_tokenizer()
    tokens = tokenize_conversation(tokenizer, Conversation(MESSAGES))
    assert tokens.ids == tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False),
                                   add_special_tokens=False)["input_ids"]  # the whole conversation, as rendered
    assert tokenizer.decode(tokens.ids[:tokens.prompt_length], skip_special_tokens=False) == \
        tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    trained, untrained = _split(tokenizer, tokens)
    assert trained == "yo<|im_end|>ok!<|im_end|>"
    assert untrained == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n\n"
    # a DPO side: only the continuation's assistant turn is trained, not an assistant turn of the prompt
    side = tokenize_conversation(tokenizer, Conversation(MESSAGES, trained_from=4))
    assert _split(tokenizer, side)[0] == "ok!<|im_end|>"


def test_the_mask_with_the_demo_models_bpe_tokenizer():
    from streamrft.engines.models import default_smollm2_dir, is_prepared
    from transformers import AutoTokenizer

    if not is_prepared(default_smollm2_dir()):
        pytest.skip("the demo model is not prepared (streamrft model prepare smollm2-135m)")
    tokenizer = AutoTokenizer.from_pretrained(str(default_smollm2_dir()))
    tokens = tokenize_conversation(tokenizer, Conversation(MESSAGES))
    assert _split(tokenizer, tokens)[0] == "yo<|im_end|>ok!<|im_end|>"


def test_a_template_that_rewrites_earlier_turns_is_refused_and_a_long_conversation_too():
    tokenizer = build_tiny_tokenizer()
    stamped = copy.copy(tokenizer)
    stamped.chat_template = "{{ messages | length }}" + tokenizer.chat_template  # the whole changes with each turn
    reason = tokenize_conversation(stamped, Conversation(MESSAGES))
    assert isinstance(reason, str) and "prefixes of the whole" in reason
    length = len(tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False), add_special_tokens=False)[
        "input_ids"])
    assert not isinstance(tokenize_conversation(tokenizer, Conversation(MESSAGES), max_tokens=length), str)
    reason = tokenize_conversation(tokenizer, Conversation(MESSAGES), max_tokens=length - 1)
    assert reason == f"{length} tokens; at most {length - 1} fit (the model's positions, or --max-tokens)"


# ------------------------------------------------------------------------------------------------ file rows
MAPPING = ChatMapping()


@pytest.mark.parametrize("row, reason", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "'messages' ends with 'user'; it must end with the assistant"),
    ({"messages": []}, "'messages' must be a non-empty list of messages"),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]},
     "'messages' message 1 (user) has content of type list"),
    ({"messages": [{"content": "hi"}]}, "'messages' message 1 has no 'role'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
     "'messages' message 2 is an empty assistant turn"),
    ({"question": "x"}, "no 'messages' and no 'prompt' + 'completion'"),
    ({"prompt": "x", "completion": ""}, "'completion' is empty"),
    ([1, 2], "row is a list"),
])
def test_sft_rows_that_cannot_be_used_say_why(row, reason):
    assert to_conversation(row, MAPPING).startswith(reason)


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "x", "chosen": "a"}, "missing 'rejected'"),
    ({"prompt": "x", "chosen": "a", "rejected": "a"}, "chosen and rejected are the same response"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
     "no 'prompt', and 'chosen' and 'rejected' share no first message"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "'chosen' ends with 'user'"),
])
def test_dpo_rows_that_cannot_be_used_say_why(row, reason):
    assert to_preference(row, MAPPING).startswith(reason)


def test_the_common_formats_become_conversations_and_pairs():
    user = {"role": "user", "content": "q"}
    assert to_conversation({"prompt": "q", "completion": "a"}, MAPPING) == Conversation(
        [user, {"role": "assistant", "content": "a"}], trained_from=1)
    assert to_conversation({"messages": [user, {"role": "assistant", "content": "a"}]}, MAPPING).trained_from == 0
    text = to_preference({"prompt": "q", "chosen": "a", "rejected": "b"}, MAPPING)
    assert (text.prompt, text.chosen, text.rejected) == ([user], [{"role": "assistant", "content": "a"}],
                                                         [{"role": "assistant", "content": "b"}])
    whole = to_preference({"chosen": [user, {"role": "assistant", "content": "a"}],
                           "rejected": [user, {"role": "assistant", "content": "b"}]}, MAPPING)
    assert whole == text  # the Anthropic HH layout: the common first messages are the prompt


# ---------------------------------------------------------------------------------------- records and config
def test_supervised_records_are_checked_where_the_trainer_reads_them():
    check_experience(SFT[0])
    check_experience(DPO[0])
    for bad, reason in ((make([1, 2, 3], 2, Objective.DPO, "p", 0, group_size=1), "bad-pair"),
                        (make([1, 2, 3], 2, Objective.DPO, "p", 2, group_size=2), "bad-pair"),
                        (make([1, 2, 3], 2, Objective.SFT, group_size=0), "out-of-range"),
                        (make([1, 2, 3, 4], 2, action_mask=[0, 0]), "no-trained-tokens")):
        with pytest.raises(InvalidRecordError) as caught:
            check_experience(bad)
        assert caught.value.reason == reason


@pytest.mark.parametrize("overrides, message", [
    ({"trainer": {"mix": {"sfT": 0.1}}}, "trainer.mix: unknown objective(s) 'sfT': trainer.mix takes sft and dpo"),
    ({"trainer": {"mix": {"sft": 1.0}}}, "trainer.mix.sft = 1.0: Input should be less than 1"),
    ({"trainer": {"mix": {"dpo": -0.1}}}, "trainer.mix.dpo = -0.1: Input should be greater than or equal to 0"),
    ({"trainer": {"mix": {"sft": 0.6, "dpo": 0.4}}}, "sft + dpo is 1: the shares of supervised rows must leave room"),
    ({"trainer": {"mix": {"sft": 0.1}}, "mode": "train"},
     "mode train has no RL rows (its batches are all supervised, in the order produced): remove trainer.mix"),
    ({"trainer": {"algorithm": {"dpo_beta": 0}}}, "trainer.algorithm.dpo_beta = 0: Input should be greater than 0"),
])
def test_bad_mix_and_mode_settings_fail_at_load_saying_how_to_fix_them(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=overrides, env={})
    assert message in str(caught.value)


def test_the_mix_shares_rows_of_the_whole_batch():
    mix = load_config(overrides={"trainer": {"mix": {"sft": 0.1}}}, env={}).trainer.mix
    assert mix.supervised_groups(64) == (7, 0)  # 64 / 0.9 = 71.1 rows, 10 % of it
    both = load_config(overrides={"trainer": {"mix": {"sft": 0.2, "dpo": 0.2}}}, env={}).trainer.mix
    assert both.supervised_groups(8) == (3, 1)  # 13.3 rows: 2.7 SFT rows, 1.3 pairs' worth of DPO rows


def test_an_explorer_started_in_mode_train_refuses_saying_why(tmp_path, capsys):
    from streamrft.cli import main

    path = tmp_path / "run.yaml"
    path.write_text("mode: train\n")
    assert main(["explorer", str(path)]) == 2
    assert "mode is train: this run has no explorer" in capsys.readouterr().err
