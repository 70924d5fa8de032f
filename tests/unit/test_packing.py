"""Micro-batches by a token budget, and sequence packing: how rows are grouped (no model), the packed layout, and
on the tiny model the same losses and gradients as padded rows of the same step (GRPO with the default loss, an
SFT batch, DPO pairs)."""
from __future__ import annotations

import logging

import pytest
import torch

from streamrft.engines.training import TrainingEngine, TrainingSettings, collate
from streamrft.engines.training.micro_batches import MicroBatching, split
from streamrft.engines.training.packing import check_packable
from streamrft.engines.training.parallel import SingleProcess
from streamrft.engines.training.supervised import dpo_backward, pair_micro_batches, sft_backward
from streamrft.schemas import Experience, Objective, RolloutKind, pack_f32, pack_i32


def make_exp(prompt: list[int], response: list[int], *, group: str = "g", reward: float = 0.0, run_index: int = 0,
             objective: Objective = Objective.RL, eid: str = "e") -> Experience:
    return Experience(eid=eid, group_id=group, task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=run_index,
                      model_version=0, tokens=pack_i32(prompt + response), prompt_length=len(prompt),
                      logprobs=pack_f32([-2.5] * len(response)), reward=reward, objective=objective)


def lengths_batch(shape: list[tuple[int, int]]):
    """Rows of the given (prompt, response) lengths."""
    return collate([make_exp([5] * p, [6] * r, eid=f"e{i}") for i, (p, r) in enumerate(shape)])


class Ranks:
    """A data-parallel strategy's row split, seen from ``rank``, without torch.distributed."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    rows = SingleProcess.rows


# ----------------------------------------------------------------------------- grouping (no model)
def test_a_token_budget_fills_micro_batches_shortest_first_counting_padding():
    batch = lengths_batch([(4, 20), (4, 2), (4, 3), (4, 1), (2, 6)])  # lengths 24, 6, 7, 5, 8
    padded = list(SingleProcess().micro_batches(batch, MicroBatching(max_tokens=24)))
    # rows 3, 1, 2: 3 x (4 + 3) = 21; + row 4 would be 4 x (4 + 6) = 40
    assert [m.rows for m in padded] == [[3, 1, 2], [4], [0]]
    assert all(len(m.batch) * m.batch.input_ids.shape[1] <= 24 for m in padded)
    packed = list(SingleProcess().micro_batches(batch, MicroBatching(max_tokens=24, pack=True)))
    assert [m.rows for m in packed] == [[3, 1, 2], [4], [0]]  # 5 + 6 + 7 = 18; + 8 = 26
    assert [m.batch.packed.num_tokens for m in packed] == [18, 8, 24]
    roomy = list(SingleProcess().micro_batches(batch, MicroBatching(max_tokens=26, pack=True)))
    assert [m.rows for m in roomy] == [[3, 1, 2, 4], [0]]


def test_a_sequence_over_the_budget_runs_alone_and_is_logged(caplog):
    batch = lengths_batch([(2, 30), (2, 3), (2, 40), (2, 2)])
    with caplog.at_level(logging.WARNING, logger="streamrft.engines.training.micro_batches"):
        micro = list(SingleProcess().micro_batches(batch, MicroBatching(max_tokens=10, pack=True)))
    assert [m.rows for m in micro] == [[3, 1], [0], [2]]
    assert ("2 micro-batch(es) over trainer.max_tokens_per_micro_batch (10), each of rows that run alone, the "
            "longest rows [2] with 42 tokens") in caplog.text


def test_a_row_count_still_splits_as_before():
    batch = lengths_batch([(2, 9), (2, 1), (2, 7), (2, 2), (2, 8), (2, 1)])
    assert [m.rows for m in SingleProcess().micro_batches(batch, 2)] == [[1, 5], [3, 2], [4, 0]]
    assert [m.rows for m in SingleProcess().micro_batches(batch, MicroBatching(rows=4))] == [[1, 5, 3, 2], [4, 0]]


def test_every_rank_runs_as_many_micro_batches_as_the_busiest():
    """Rank 0's rows are long (three micro-batches at this budget), rank 1's short (one): rank 1 pads."""
    batch = lengths_batch([(2, 20), (2, 20), (2, 20), (2, 1), (2, 1), (2, 1)])
    how = MicroBatching(max_tokens=30, pack=True)
    splits = [list(split(batch, how, Ranks(rank, 2))) for rank in (0, 1)]
    assert [[m.rows for m in s] for s in splits] == [[[0], [1], [2]], [[3, 4, 5], [], []]]
    assert [m.padding for m in splits[1]] == [False, True, True]
    assert splits[1][1].batch.packed is not None and splits[1][1].batch.response_mask.sum() == 0


def test_dpo_pairs_stay_whole_under_a_budget():
    sides = [(3, 10), (3, 12), (3, 1), (3, 2), (3, 4), (3, 3)]  # pairs of 13 + 15, 4 + 5 and 7 + 6 tokens
    batch = lengths_batch(sides)
    by_tokens = [m.rows for m in pair_micro_batches(SingleProcess(), batch, MicroBatching(max_tokens=22, pack=True))]
    assert by_tokens == [[2, 3, 4, 5], [0, 1]]
    tight = [m.rows for m in pair_micro_batches(SingleProcess(), batch, MicroBatching(max_tokens=12, pack=True))]
    assert tight == [[2, 3], [4, 5], [0, 1]]
    assert [m.rows for m in pair_micro_batches(SingleProcess(), batch, 4)] == [[2, 3, 4, 5], [0, 1]]


def test_settings_take_the_budget_and_packing():
    s = TrainingSettings(max_tokens_per_micro_batch=4096, pack_sequences=True)
    assert MicroBatching.of(s) == MicroBatching(rows=8, max_tokens=4096, pack=True)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        TrainingSettings(max_tokens_per_micro_batch=0)


# ----------------------------------------------------------------------------- the packed layout (no model)
def test_packing_lays_the_sequences_end_to_end_with_positions_restarting():
    batch = collate([make_exp([1, 2, 3], [4, 5]), make_exp([7, 8], [9, 10, 11]), make_exp([12], [])])
    packed = batch.pack().packed
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]]
    # the logit at column c predicts the token at c + 1: 4 and 5 after columns 2, 3; 9, 10, 11 after 6, 7, 8
    assert packed.logit_index.tolist() == [2, 3, 6, 7, 8]
    assert packed.targets.tolist() == [4, 5, 9, 10, 11]
    assert packed.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])).tolist() == [[1, 2, 0], [3, 4, 5], [0, 0, 0]]
    assert batch.select([1]).packed is None  # a selection is packed again by whoever runs it


# ----------------------------------------------------------------------------- on the tiny model
def long_tail(groups: int = 3, per_group: int = 4) -> list[Experience]:
    """Groups of answers, most short and one per group long, with rewards that differ within each group."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for g in range(groups):
        prompt = torch.randint(4, 40, (3 + g,), generator=generator).tolist()
        for k in range(per_group):
            length = 24 if k == 0 else int(torch.randint(1, 6, (1,), generator=generator))
            response = torch.randint(4, 40, (length,), generator=generator).tolist()
            out.append(make_exp(prompt, response, group=f"g{g}", reward=float(k % 2), run_index=k,
                                eid=f"e{g}-{k}"))
    return out


WAYS = {  # trainer settings of the same step: padded rows, a token budget, packed sequences under the budget
    "padded rows": dict(micro_batch_size=4),
    "token budget": dict(max_tokens_per_micro_batch=40),
    "packed": dict(max_tokens_per_micro_batch=40, pack_sequences=True),
}


def engines(tiny_model_dir, **settings) -> dict[str, TrainingEngine]:
    return {way: TrainingEngine.from_pretrained(tiny_model_dir, TrainingSettings(lr=1e-3, **settings, **how),
                                                device="cpu") for way, how in WAYS.items()}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(engines: dict[str, TrainingEngine]) -> None:
    expected = grads(engines["padded rows"].model)
    assert expected and all(g.abs().sum() > 0 for g in expected.values())
    for way, engine in engines.items():
        got = grads(engine.model)
        assert got.keys() == expected.keys(), way
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=f"{way}: {name}")


@pytest.mark.model
@pytest.mark.parametrize("one_update", [False, True], ids=["old logprobs by a forward", "in the training pass"])
def test_grpo_loss_and_gradients_match_padded_rows(tiny_model_dir, one_update):
    """The default loss (ppo_clip, token-mean, recomputed old logprobs): with ``one_update`` those come from the
    training forward itself, else from a no-grad forward that is micro-batched (and packed) the same way."""
    experiences = long_tail()
    ways = engines(tiny_model_dir, entropy_coef=0.01)
    metrics, old = {}, {}
    for way, engine in ways.items():
        batch = engine.prepare(experiences, one_update=one_update)
        metrics[way] = engine.backward(batch)
        old[way] = batch.old_logprobs
    for way in ways:
        for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/ratio_mean"):
            assert metrics[way][key] == pytest.approx(metrics["padded rows"][key], abs=1e-6), (way, key)
        torch.testing.assert_close(old[way], old["padded rows"], atol=1e-5, rtol=0)
    assert_same_gradients(ways)


@pytest.mark.model
@pytest.mark.parametrize("attention", [None, "eager"])
def test_logprobs_of_packed_rows_are_each_sequence_s_own(tiny_model_dir, attention):
    """Against each sequence run alone: a token attending across a sequence boundary would change them. Under
    transformers' default attention (sdpa) and eager, each building its block-diagonal mask."""
    experiences = long_tail(groups=2)
    settings = TrainingSettings(max_tokens_per_micro_batch=64, pack_sequences=True, attn_implementation=attention)
    engine = TrainingEngine.from_pretrained(tiny_model_dir, settings, device="cpu")
    assert engine.model.config._attn_implementation == (attention or "sdpa")
    logp = engine.compute_logprobs(engine.collate(experiences))
    for i, exp in enumerate(experiences):
        alone = engine.compute_logprobs(engine.collate([exp]))
        torch.testing.assert_close(logp[i, : exp.response_length], alone[0, : exp.response_length],
                                   atol=1e-5, rtol=0)


@pytest.mark.model
def test_the_critic_s_values_and_value_loss_gradients_match_padded_rows(tiny_model_dir):
    """PPO with a critic: the value model runs on the same packed micro-batches as the policy, its values read at
    the columns of the policy's logits."""
    ways = engines(tiny_model_dir, advantage="gae", critic={"lr": 1e-3})
    metrics, values = {}, {}
    for way, engine in ways.items():
        assert engine.critic.micro_batching.pack == (way == "packed")
        batch = engine.prepare(long_tail())
        values[way] = batch.values
        metrics[way] = engine.critic.update(batch)
    for way in ways:
        torch.testing.assert_close(values[way], values["padded rows"], atol=1e-5, rtol=0)
        for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"):
            assert metrics[way][key] == pytest.approx(metrics["padded rows"][key], rel=1e-4, abs=1e-6), (way, key)
    expected = grads(ways["padded rows"].critic.model)
    assert expected and all(g.abs().sum() > 0 for g in expected.values())
    for way, engine in ways.items():
        got = grads(engine.critic.model)
        assert got.keys() == expected.keys(), way
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=f"{way}: {name}")


@pytest.mark.model
def test_an_sft_batch_has_the_same_loss_and_gradients(tiny_model_dir):
    rows = [make_exp(e.token_array[: e.prompt_length].tolist(), e.token_array[e.prompt_length:].tolist(),
                     objective=Objective.SFT, eid=e.eid) for e in long_tail()]
    ways = engines(tiny_model_dir)
    losses = {way: sft_backward(engine, engine.collate(rows))["sft/loss"] for way, engine in ways.items()}
    assert losses["token budget"] == pytest.approx(losses["padded rows"], abs=1e-6)
    assert losses["packed"] == pytest.approx(losses["padded rows"], abs=1e-6)
    assert_same_gradients(ways)


@pytest.mark.model
def test_dpo_pairs_have_the_same_loss_and_gradients(tiny_model_dir):
    pairs = []
    for k, e in enumerate(long_tail(groups=2)):
        prompt = e.token_array[: e.prompt_length].tolist()
        pairs.append(make_exp(prompt, e.token_array[e.prompt_length:].tolist(), group=f"p{k // 2}",
                              run_index=k % 2, objective=Objective.DPO, eid=e.eid))
    for k in range(0, len(pairs), 2):  # both sides of a pair follow the same prompt
        pairs[k + 1] = make_exp(pairs[k].token_array[: pairs[k].prompt_length].tolist(),
                                pairs[k + 1].token_array[pairs[k + 1].prompt_length:].tolist(),
                                group=pairs[k].group_id, run_index=1, objective=Objective.DPO, eid=pairs[k + 1].eid)
    ways = engines(tiny_model_dir)
    losses = {way: dpo_backward(engine, engine.collate(pairs))["dpo/loss"] for way, engine in ways.items()}
    assert losses["packed"] == pytest.approx(losses["padded rows"], abs=1e-6)
    assert losses["token budget"] == pytest.approx(losses["padded rows"], abs=1e-6)
    assert_same_gradients(ways)


def test_packing_refuses_a_model_whose_masks_ignore_packed_positions():
    """Its packed sequences would attend to each other: refused by name instead of training on that."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    class OwnMasks(PreTrainedModel):  # its module does not import transformers' mask functions
        config_class = LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(2, 2)

    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    with pytest.raises(ValueError, match="OwnMasks does not build its attention mask with transformers' masking_utils"
                                         ".*set trainer.pack_sequences: false"):
        check_packable(torch.nn.Sequential(OwnMasks(config)))
    check_packable(torch.nn.Sequential(LlamaForCausalLM(config)))  # a wrapper (DDP, peft) holds the model
