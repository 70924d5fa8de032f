"""A model-free engine for fast tests and the worker-scaling benchmark.

Each sample takes ``latency_s`` of wall time (``time.sleep``, which releases the GIL as a GPU call would) and
returns deterministic tokens: by default a few digits derived from the prompt, the sample index and the seed;
with ``responder`` the text it returns for the prompt text (tokenised with the engine's tokenizer). Every logprob
is ``logprob``. Weights are only recorded, so ``load_weights`` and ``version`` behave like a real engine's.

``incremental=True`` models an engine with room in its batch (vLLM below ``max_num_seqs``): a submitted call
takes its ``latency_s`` per sample from the moment it is submitted, whatever else runs, and :meth:`step` hands
back the calls whose time is up -- so tests can see requests finish out of order.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .base import (
    Completion,
    GenerationCall,
    InferenceEngine,
    Prompt,
    SamplingParams,
    WeightsInput,
    announce_whole,
    find_stop,
    iter_weights,
    per_prompt_params,
)

# responder(prompt_text, sample_index) -> response text
Responder = Callable[[str, int], str]


def _shape(value: Any) -> tuple[int, ...] | None:
    """A recorded weight's shape (tensors, arrays); None for values without one."""
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


class FakeEngine(InferenceEngine):
    kind = "fake"

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        *,
        latency_s: float = 0.0,
        responder: Responder | None = None,
        logprob: float = -1.0,
        version: int = 0,
        incremental: bool = False,
    ) -> None:
        self.incremental = incremental
        self._due: list[tuple[float, Any, list[list[Completion]] | BaseException]] = []
        if model_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        else:
            from ..models import build_tiny_tokenizer

            self.tokenizer = build_tiny_tokenizer()
        self.latency_s = latency_s
        self.responder = responder
        self.logprob = logprob
        self._version = version
        self._weights: dict[str, Any] = {}
        self.calls = 0  # generate() calls, for tests

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams], n: int = 1
    ) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.calls += 1
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        if self.latency_s:
            time.sleep(self.latency_s * n * len(prompts))
        return [
            [self._sample(ids, j, p) for j in range(n)]
            for ids, p in zip(prompt_ids, per_prompt_params(params, len(prompts)))
        ]

    def submit(self, key, prompts, params, n: int = 1, on_tokens=None) -> None:
        if not self.incremental:
            return super().submit(key, prompts, params, n, on_tokens)
        self.calls += 1
        try:
            result: list[list[Completion]] | BaseException = [
                [self._sample(self.prompt_ids(p), j, sp) for j in range(n)]
                for p, sp in zip(prompts, per_prompt_params(params, len(prompts)))]
        except Exception as exc:  # noqa: BLE001 - the call fails alone, as in a real engine
            result = exc
        call = GenerationCall(key, list(prompts), per_prompt_params(params, len(prompts)), n, on_tokens)
        self._due.append((time.monotonic() + self.latency_s * n * len(prompts), call, result))

    def step(self):
        if not self.incremental:
            return super().step()
        if not self._due:
            return []
        # a step is short (as vLLM's): calls submitted meanwhile join at the next one
        time.sleep(min(0.02, max(0.0, min(due for due, _, _ in self._due) - time.monotonic())))
        now = time.monotonic()
        finished = []
        for due, call, result in self._due:
            if due <= now:
                if not isinstance(result, BaseException):
                    announce_whole(call, result)
                finished.append((call.key, result))
        self._due = [entry for entry in self._due if entry[0] > now]
        return finished

    def abort(self, keys) -> None:
        if not self.incremental:
            return super().abort(keys)
        dropped = set(keys)
        self._due = [entry for entry in self._due if entry[1].key not in dropped]

    @property
    def unfinished(self) -> int:
        return len(self._due) if self.incremental else super().unfinished

    def _sample(self, prompt_ids: list[int], index: int, params: SamplingParams) -> Completion:
        if self.responder is not None:
            text = self.responder(self.decode(prompt_ids, skip_special_tokens=False), index)
        else:
            digest = hashlib.sha256(f"{prompt_ids}|{params.sample_seed(index)}".encode()).digest()
            text = str(int.from_bytes(digest[:4], "little") % 100)
        response = self.encode(text)
        finish, stop_reason = "stop", None
        found = find_stop(text, params.stop)
        if found is not None:
            text, stop_reason = text[: found[0]], found[1]
            response = self.encode(text + found[1])
        if len(response) >= params.max_tokens:
            response, finish, stop_reason = response[: params.max_tokens], "length", None
            text = self.decode(response)
        elif stop_reason is None:
            response = response + [self.eos_token_id]
        return Completion(
            prompt_ids=list(prompt_ids),
            response_ids=response,
            logprobs=[self.logprob] * len(response),
            text=text,
            finish_reason=finish,
            model_version=self._version,
            stop_reason=stop_reason,
        )

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Like a real engine once it holds weights: unknown names and other shapes are refused. Before the
        first load it has no model to compare with and accepts anything."""
        if not self._weights:
            return
        unknown = [name for name in shapes if name not in self._weights]
        if unknown:
            raise ValueError(f"unknown parameter names (first 5 of {len(unknown)}): {unknown[:5]}")
        wrong = [f"{name}: {tuple(shape)} != {_shape(self._weights[name])}" for name, shape in shapes.items()
                 if _shape(self._weights[name]) not in (None, tuple(shape))]
        if wrong:
            raise ValueError(f"shape mismatch: {wrong[:5]}")

    def load_weights(self, weights: WeightsInput, version: int) -> None:
        # all checked before anything changes, as a real engine does: a refused load keeps the old weights
        incoming = dict(iter_weights(weights))
        self.check_weights({name: _shape(t) or () for name, t in incoming.items()})
        self._weights.update(incoming)
        self._version = version

    def state_dict(self) -> dict[str, Any]:
        return dict(self._weights)
