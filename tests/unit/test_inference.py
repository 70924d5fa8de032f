"""Inference engines: the transformers engine on the tiny model, the fake engine, the registry."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from streamrft.engines.inference import EngineError, SamplingParams, create_engine
from streamrft.engines.inference.base import find_stop
from streamrft.engines.inference.hf import TransformersEngine, filter_logits

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]
LONGER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 19? Think first."}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> TransformersEngine:
    return create_engine("transformers", tiny_model_dir, device="cpu")


def teacher_forced_logprobs(engine: TransformersEngine, prompt_ids, response_ids, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token from one forward pass over prompt + response."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt_ids) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


@pytest.mark.model
def test_shapes_and_prompt_ids(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=7, seed=0)
    out = engine.generate([QUESTION, LONGER], params, n=3)
    assert [len(samples) for samples in out] == [3, 3]
    expected_prompt = engine.encode(engine.render_chat(QUESTION))
    for i, samples in enumerate(out):
        for c in samples:
            assert len(c.response_ids) == len(c.logprobs) <= 7
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            assert c.model_version == 0
            if c.finish_reason == "length":
                assert len(c.response_ids) == 7
            if i == 0:
                assert c.prompt_ids == expected_prompt
    # token-id prompts are used as given
    ids = out[0][0].prompt_ids + out[0][0].response_ids
    (again,) = engine.generate([ids], params, n=1)
    assert again[0].prompt_ids == ids


@pytest.mark.model
def test_seed_determinism(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=12, seed=7)
    first = engine.generate_one(QUESTION, params, n=3)
    second = engine.generate_one(QUESTION, params, n=3)
    assert [c.response_ids for c in first] == [c.response_ids for c in second]
    assert len({tuple(c.response_ids) for c in first}) == 3  # seed + j: the samples differ
    other = engine.generate_one(QUESTION, params.replace(seed=8), n=1)
    assert other[0].response_ids != first[0].response_ids
    assert other[0].response_ids == first[1].response_ids  # sample 1 of seed 7 is seeded 8


@pytest.mark.model
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=16, seed=1),
        SamplingParams(temperature=0.7, max_tokens=16, seed=2),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_tokens=16, seed=3),
        SamplingParams(temperature=0.0, max_tokens=16),
    ],
    ids=["t1", "t0.7", "t1.3-topk-topp", "greedy"],
)
def test_logprobs_equal_teacher_forced(engine: TransformersEngine, params: SamplingParams) -> None:
    out = engine.generate([QUESTION, LONGER], params, n=2)
    for samples in out:
        for c in samples:
            expected = teacher_forced_logprobs(engine, c.prompt_ids, c.response_ids, params.logprob_temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.model
def test_greedy_picks_the_argmax(engine: TransformersEngine) -> None:
    (c,) = engine.generate_one(QUESTION, SamplingParams(temperature=0, max_tokens=6))
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1]
    assert logits.argmax(-1).tolist() == c.response_ids


@pytest.mark.model
def test_batched_equals_unbatched(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=10, seed=11)
    batched = engine.generate([QUESTION, LONGER], params, n=2)
    alone = [engine.generate_one(QUESTION, params, n=2), engine.generate_one(LONGER, params, n=2)]
    saved = engine.max_batch_size
    engine.max_batch_size = 1
    try:
        one_by_one = engine.generate([QUESTION, LONGER], params, n=2)
    finally:
        engine.max_batch_size = saved
    for other in (alone, one_by_one):
        for xs, ys in zip(batched, other):
            for x, y in zip(xs, ys):
                assert x.response_ids == y.response_ids
                torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.model
def test_per_prompt_params(engine: TransformersEngine) -> None:
    a, b = SamplingParams(max_tokens=5, seed=1), SamplingParams(max_tokens=9, temperature=0.5, seed=2)
    out = engine.generate([QUESTION, QUESTION], [a, b], n=1)
    assert out[0][0].response_ids == engine.generate_one(QUESTION, a)[0].response_ids
    assert out[1][0].response_ids == engine.generate_one(QUESTION, b)[0].response_ids
    with pytest.raises(ValueError):
        engine.generate([QUESTION], [a, b])


@pytest.mark.model
def test_stop_string_cuts_text_keeps_sampled_token(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=16, seed=5)
    (free,) = engine.generate_one(QUESTION, params)
    stop = free.text[3]  # character level: the 4th token's text
    (stopped,) = engine.generate_one(QUESTION, params.replace(stop=(stop,)))
    cut = free.text.index(stop)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[:cut]
    assert stopped.response_ids == free.response_ids[: cut + 1]
    assert len(stopped.logprobs) == cut + 1


@pytest.mark.model
def test_load_weights_changes_outputs_and_version(engine: TransformersEngine) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    before = engine.generate_one(QUESTION, greedy)[0]
    original = {k: v.clone() for k, v in engine.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    # one entry per parameter (tied lm_head / embeddings share one), as a trainer sends them
    matrices = [name for name, p in engine.model.named_parameters() if p.ndim == 2]
    changed = {k: original[k] + 0.5 * torch.randn(original[k].shape, generator=generator) for k in matrices}
    try:
        engine.load_weights(changed, version=3)
        assert engine.version == 3
        after = engine.generate_one(QUESTION, greedy)[0]
        assert after.model_version == 3
        assert after.response_ids != before.response_ids or after.logprobs != pytest.approx(before.logprobs)
        name = next(iter(changed))
        assert torch.equal(engine.state_dict()[name], changed[name])

        with pytest.raises(ValueError, match="unknown"):
            engine.load_weights({"no.such.weight": torch.zeros(1)}, version=4)
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights([(name, torch.zeros(3, 3))], version=4)
        assert engine.version == 3
    finally:
        engine.load_weights(original.items(), version=0)  # an iterable of pairs works too
    restored = engine.generate_one(QUESTION, greedy)[0]
    assert restored.response_ids == before.response_ids
    assert restored.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=1.0)).all()


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(temperature=0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.6).logprob_temperature == 0.6
    assert find_stop("abc\n\nxyz", ["xy", "\n\n"]) == (3, "\n\n")


def test_registry_errors() -> None:
    with pytest.raises(EngineError, match="unknown inference engine"):
        create_engine("nope", "x")
    with pytest.raises(EngineError, match="model path"):
        create_engine("transformers")


def test_vllm_engine_refuses_a_missing_model_before_starting_vllm(tmp_path) -> None:
    from streamrft.engines.inference import vllm as vllm_engine

    with pytest.raises(EngineError, match="cannot load a model from"):
        vllm_engine.VLLMEngine(tmp_path / "nonexistent")


def test_fake_engine_is_deterministic_and_versioned() -> None:
    engine = create_engine("fake", latency_s=0.01)
    params = SamplingParams(max_tokens=8, seed=1)
    started = time.monotonic()
    first = engine.generate([QUESTION, LONGER], params, n=2)
    assert time.monotonic() - started >= 0.04  # latency per sample
    again = engine.generate([QUESTION, LONGER], params, n=2)
    assert [[c.response_ids for c in s] for s in first] == [[c.response_ids for c in s] for s in again]
    for samples in first:
        for c in samples:
            assert c.finish_reason == "stop" and c.response_ids[-1] == engine.eos_token_id
            assert c.text.isdigit() and len(c.logprobs) == len(c.response_ids)
    engine.load_weights({"w": torch.ones(2)}, version=5)
    assert engine.version == 5 and engine.generate_one(QUESTION, params)[0].model_version == 5
    assert set(engine.state_dict()) == {"w"}


def test_fake_engine_responder_stop_and_length() -> None:
    engine = create_engine("fake", responder=lambda prompt, j: f"answer {j}. more")
    (a, b) = engine.generate_one(QUESTION, SamplingParams(stop=(".",)), n=2)
    assert (a.text, b.text) == ("answer 0", "answer 1")
    assert a.stop_reason == "." and engine.decode(a.response_ids) == "answer 0."
    (c,) = engine.generate_one(QUESTION, SamplingParams(max_tokens=3))
    assert c.finish_reason == "length" and c.text == "ans" and len(c.response_ids) == 3


def test_vllm_engine_without_vllm_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    import sys

    from streamrft.engines.inference import vllm as vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without it: the import fails
    with pytest.raises(EngineError, match=r"pip install 'streamrft\[vllm\]'.*setup.sh --vllm"):
        vllm_engine.VLLMEngine(tmp_path)
