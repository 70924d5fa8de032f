"""What serve mode asks of the vLLM engine besides samples (the CPU build here, the same Python API as on a
GPU): guided decoding to a JSON schema (``response_format``, a required tool call), the alternatives at each
position and the prompt's own logprobs (``logprobs``/``top_logprobs``, ``echo``), the latter equal to the
transformers engine's."""
from __future__ import annotations

import json

import pytest

from streamrft.engines.inference import SamplingParams, create_engine

pytestmark = [pytest.mark.model, pytest.mark.vllm]

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


def test_vllm_guides_to_a_schema_and_gives_alternatives_and_prompt_logprobs(tiny_model_dir):
    engine = create_engine("vllm", tiny_model_dir, dtype="float32", kv_cache_gib=1, enforce_eager=True,
                           max_model_len=512)
    try:
        assert engine.structured_outputs
        guided = engine.generate([[{"role": "user", "content": "Weather?"}]],
                                 SamplingParams(temperature=1.0, max_tokens=60, seed=4,
                                                json_schema=json.dumps(SCHEMA)), n=2)[0]
        for completion in guided:
            value = json.loads(completion.text)  # the random tiny model writes JSON only when guided
            assert set(value) == {"city", "days"} and 0 <= value["days"] <= 9, completion.text
        prompt = engine.encode("3 + 4 = 7")
        (completion,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, top_logprobs=2,
                                                                 prompt_logprobs=1))[0]
        assert len(completion.top_logprobs) == len(completion.response_ids)
        for token, logprob, top in zip(completion.response_ids, completion.logprobs, completion.top_logprobs):
            assert top[token] == pytest.approx(logprob, abs=1e-5) and len(top) >= 2
            assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the sampled is the best
        reference = create_engine("transformers", tiny_model_dir, device="cpu")
        expected = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0][0]
        assert completion.prompt_logprobs[0] is None and expected.prompt_logprobs[0] is None
        for token, ours, theirs in zip(prompt[1:], completion.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
            assert ours[token] == pytest.approx(theirs[token], abs=1e-4)
            assert max(ours.values()) == pytest.approx(max(theirs.values()), abs=1e-4)
        reference.close()
    finally:
        engine.close()
