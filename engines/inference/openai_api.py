"""An external engine: roll out through any OpenAI-compatible endpoint (vLLM's server, a hosted model,
``streamrft serve``) with the official ``openai`` client.

For evaluation, bench runs, LLM-as-judge rewards and distillation data: it takes no weights (a published version
is refused by the weight follower as ``incompatible-weights``, and the endpoint keeps serving what it serves).
Chat prompts go to ``/v1/chat/completions``, token-id prompts to ``/v1/completions``; the ``n`` samples of a
prompt are one request (``n``), the prompts of a call run concurrently, up to ``max_concurrency``.

Token ids are the local tokenizer's (``model.path``): the prompt through its chat template, the response text
re-encoded. The logprobs are the endpoint's when it returns one per token and the count matches the local
tokenization (the same tokenizer on both sides); otherwise they are 0 and the completion says so in its
``metrics["engine/logprobs_missing"]`` — such samples are fine to evaluate, not to train on as on-policy data.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import Completion, EngineError, InferenceEngine, Prompt, SamplingParams, WeightsInput


class OpenAIEngine(InferenceEngine):
    kind = "openai"

    def __init__(self, model_path: str | os.PathLike, *, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 600.0, max_concurrency: int = 16, **_ignored: Any) -> None:
        try:
            import openai
        except ImportError as exc:
            raise EngineError("rollout.engine: openai needs the openai package (pip install openai)") from exc
        from transformers import AutoTokenizer

        if not base_url:
            raise EngineError("rollout.engine: openai needs rollout.openai.base_url (e.g. http://host:8000/v1)")
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=2)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="openai-engine")

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 n: int = 1) -> list[list[Completion]]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        return list(self._pool.map(lambda pair: self._one(pair[0], pair[1], n), zip(prompts, per_prompt)))

    def _one(self, prompt: Prompt, params: SamplingParams, n: int) -> list[Completion]:
        if params.top_k:
            raise EngineError("the OpenAI API has no top_k: set rollout.sampling.top_k to 0 for rollout.engine "
                              "openai")
        common = {"model": self.model, "n": n, "temperature": params.temperature, "top_p": params.top_p,
                  "max_tokens": params.max_tokens, "seed": params.seed, "stop": list(params.stop) or None}
        prompt_ids = self.prompt_ids(prompt)
        if isinstance(prompt[0], Mapping):
            response = self.client.chat.completions.create(messages=[dict(m) for m in prompt], logprobs=True,
                                                           **common)
            samples = [(c.message.content or "", c.finish_reason,
                        [t.logprob for t in (c.logprobs.content or [])] if c.logprobs else None)
                       for c in sorted(response.choices, key=lambda c: c.index)]
        else:
            response = self.client.completions.create(prompt=prompt_ids, logprobs=0, **common)
            samples = [(c.text, c.finish_reason, list(c.logprobs.token_logprobs) if c.logprobs else None)
                       for c in sorted(response.choices, key=lambda c: c.index)]
        return [self._completion(prompt_ids, *sample) for sample in samples]

    def _completion(self, prompt_ids: list[int], text: str, finish: str | None,
                    logprobs: list[float] | None) -> Completion:
        response_ids = self.encode(text)
        metrics = {}
        if logprobs is None or len(logprobs) != len(response_ids):
            logprobs, metrics = [0.0] * len(response_ids), {"engine/logprobs_missing": 1.0}
        return Completion(prompt_ids=prompt_ids, response_ids=response_ids, logprobs=[float(x) for x in logprobs],
                          text=text, finish_reason="length" if finish == "length" else "stop",
                          model_version=self._version, metrics=metrics)

    def load_weights(self, weights: WeightsInput, version: int) -> None:
        raise ValueError("rollout.engine openai takes no weights: the endpoint serves its own model")

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        raise ValueError("rollout.engine openai takes no weights: the endpoint serves its own model")

    def state_dict(self):
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
