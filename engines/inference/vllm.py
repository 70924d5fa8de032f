"""The vLLM engine (one CUDA GPU), behind the same interface as the transformers engine.

``vllm`` is imported only when an engine is built, so this module imports anywhere; construction fails with an
:class:`EngineError` that says what is missing when there is no vLLM or no GPU.

Logprobs follow the contract in ``base.py``: vLLM is started with ``logprobs_mode="processed_logprobs"``, i.e.
``log_softmax(logits / T)`` of the sampled token. vLLM computes them *after* top-k / top-p renormalisation, so
this engine refuses ``top_k > 0`` or ``top_p < 1`` rather than return logprobs that differ from the trainer's.

Weights are loaded in place through ``LLM.apply_model`` (``model.load_weights`` on the worker, which maps
Hugging Face names onto vLLM's fused layers); the engine runs vLLM's core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tensors are not pickled. Not exercised by the CPU test suite.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from .base import (
    Completion,
    EngineError,
    InferenceEngine,
    Prompt,
    SamplingParams,
    WeightsInput,
    iter_weights,
    per_prompt_params,
)

logger = logging.getLogger(__name__)


class VLLMEngine(InferenceEngine):
    kind = "vllm"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        version: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        try:
            import torch
            import vllm
        except ImportError as exc:
            raise EngineError(
                "the vllm engine needs the vllm package on a CUDA machine: pip install 'streamrft[vllm]' "
                f"(import failed: {exc}); on CPU use engine 'transformers'"
            ) from exc
        if not torch.cuda.is_available():
            raise EngineError("the vllm engine needs a CUDA GPU and none is visible; use engine 'transformers'")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._version = version

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams], n: int = 1
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        requests, params_list, owners = [], [], []
        for i, (prompt, sample_params) in enumerate(zip(prompts, per_prompt_params(params, len(prompts)))):
            if sample_params.top_k > 0 or sample_params.top_p < 1.0:
                raise ValueError(
                    "the vllm engine returns logprobs after top-k/top-p renormalisation, which a trainer cannot "
                    "reproduce; sample with top_k=0 and top_p=1.0"
                )
            ids = self.prompt_ids(prompt)
            # with a seed, one request per sample so sample j is seeded seed + j, as in the other engines
            per_request = [(j, 1) for j in range(n)] if sample_params.seed is not None else [(0, n)]
            for j, count in per_request:
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params_list.append(self._vllm_params(sample_params, count, sample_params.sample_seed(j)))
                owners.append(i)
        outputs = self.llm.generate(requests, params_list, use_tqdm=False)
        result: list[list[Completion]] = [[] for _ in prompts]
        for owner, output in zip(owners, outputs):
            for sample in output.outputs:
                result[owner].append(self._completion(list(output.prompt_token_ids), sample))
        return result

    def _vllm_params(self, params: SamplingParams, n: int, seed: int | None):
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=1.0,
            top_k=-1,
            max_tokens=params.max_tokens,
            seed=seed,
            stop=list(params.stop) or None,
            logprobs=0,  # the sampled token's logprob only
        )

    def _completion(self, prompt_ids: list[int], sample: Any) -> Completion:
        ids = list(sample.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, sample.logprobs)]
        stop_reason = sample.stop_reason if isinstance(sample.stop_reason, str) else None
        return Completion(
            prompt_ids=prompt_ids,
            response_ids=ids,
            logprobs=logprobs,
            text=sample.text,
            finish_reason="length" if sample.finish_reason == "length" else "stop",
            model_version=self._version,
            stop_reason=stop_reason,
        )

    def load_weights(self, weights: WeightsInput, version: int) -> None:
        pending = [(name, tensor) for name, tensor in iter_weights(weights)]
        self.llm.apply_model(lambda model: model.load_weights(pending))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._version = version

    def state_dict(self) -> dict[str, Any]:
        """vLLM's own parameter names (fused ``qkv_proj`` / ``gate_up_proj``), copied to CPU."""
        states = self.llm.apply_model(lambda model: {k: v.detach().cpu() for k, v in model.state_dict().items()})
        return states[0]

    def close(self) -> None:
        self.llm = None  # type: ignore[assignment]
