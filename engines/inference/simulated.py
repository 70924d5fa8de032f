"""A model-free engine that decodes as vLLM does, for the scale benchmark: a stand-in for a GPU's batch.

Each :meth:`~SimulatedEngine.step` takes ``step_s`` of wall time (``time.sleep``, which releases the GIL as a
GPU kernel would) and adds one token to every running sample, at most ``max_num_seqs`` of them; samples beyond
that wait in order, as in vLLM's scheduler. A sample's length is drawn from its prompt and seed, uniformly
between ``min_tokens`` and its ``max_tokens``, so a batch holds short and long samples and ends with its longest,
which is what makes a step barrier cost idle time. Calls come back as soon as their own samples are done.

Weights are only recorded; a load may happen between steps while samples run (``loads_in_flight``): their next
tokens are the new version's, their completions say where it began (``Completion.version_switches``), and every
token's logprob is that of its version (``logprob_of(version)``), so tests can tell the versions apart.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import (
    Completion,
    Finished,
    InferenceEngine,
    Prompt,
    SamplingParams,
    TokenListener,
    WeightsInput,
    iter_weights,
    per_prompt_params,
)


def logprob_of(version: int) -> float:
    """The logprob of every token generated on ``version``: distinct for each version."""
    return -1.0 / (1 + version)


@dataclass(eq=False)
class _Sample:
    call: "_Call"
    prompt: int
    index: int
    prompt_ids: list[int]
    length: int
    first_token: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None  # of its first token, once it has one
    switches: list[tuple[int, int]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.ids) >= self.length


@dataclass(eq=False)
class _Call:
    key: Hashable
    samples: list[_Sample]
    on_tokens: TokenListener | None = None


class SimulatedEngine(InferenceEngine):
    kind = "simulated"
    incremental = True
    loads_in_flight = True

    def __init__(self, model_path: str | os.PathLike | None = None, *, step_s: float = 0.05,
                 max_num_seqs: int = 64, min_tokens: int = 4, version: int = 0) -> None:
        if model_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        else:
            from ..models import build_tiny_tokenizer

            self.tokenizer = build_tiny_tokenizer()
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.min_tokens = min_tokens
        self._version = version
        self._weights: dict[str, Any] = {}
        self._calls: dict[Hashable, _Call] = {}
        self._waiting: deque[_Sample] = deque()
        self._running: list[_Sample] = []
        self.steps = 0
        self.token_steps = 0  # sum over steps of the samples each advanced: the batch's fill, for benchmarks

    # -- generation ----------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 n: int = 1) -> list[list[Completion]]:
        key = ("generate", object())
        self.submit(key, prompts, params, n)
        while True:
            for done_key, result in self.step():
                if done_key is key:
                    return result

    def submit(self, key: Hashable, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
               n: int = 1, on_tokens: TokenListener | None = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        call = _Call(key, [], on_tokens)
        for i, (prompt, sample_params) in enumerate(zip(prompts, per_prompt_params(params, len(prompts)))):
            ids = self.prompt_ids(prompt)
            for j in range(n):
                digest = hashlib.sha256(f"{ids}|{sample_params.sample_seed(j)}|{j}".encode()).digest()
                span = max(0, sample_params.max_tokens - self.min_tokens)
                length = min(sample_params.max_tokens, self.min_tokens + int.from_bytes(digest[:4], "little") % (span + 1))
                call.samples.append(_Sample(call, i, j, ids, max(1, length), first_token=3 + digest[1] % 10))
        self._calls[key] = call
        self._waiting.extend(call.samples)

    def step(self) -> list[Finished]:
        """One decode step of the running batch (admitting waiting samples first); the calls now done."""
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.popleft())
        if not self._running:
            return []
        time.sleep(self.step_s)
        self.steps += 1
        self.token_steps += len(self._running)
        for sample in self._running:
            self._decode_one(sample)
        self._running = [s for s in self._running if not s.done]
        finished = []
        for key, call in list(self._calls.items()):
            if all(s.done for s in call.samples):
                del self._calls[key]
                finished.append((key, self._result(call)))
        return finished

    def _decode_one(self, sample: _Sample) -> None:
        if sample.version is None:
            sample.version = self._version
        token = sample.first_token + len(sample.ids) % 7
        logprob = logprob_of(self._version)
        sample.ids.append(token)
        sample.logprobs.append(logprob)
        if sample.call.on_tokens is not None:
            sample.call.on_tokens(sample.prompt, sample.index, [token], [logprob])

    def _result(self, call: _Call) -> list[list[Completion]]:
        rows: list[list[Completion]] = []
        for sample in call.samples:
            if sample.prompt == len(rows):
                rows.append([])
            rows[sample.prompt].append(Completion(
                prompt_ids=list(sample.prompt_ids), response_ids=list(sample.ids), logprobs=list(sample.logprobs),
                text=self.decode(sample.ids), finish_reason="length", model_version=sample.version,
                version_switches=list(sample.switches)))
        return rows

    def abort(self, keys: Iterable[Hashable]) -> None:
        dropped = {key for key in keys if key in self._calls}
        for key in dropped:
            del self._calls[key]
        self._waiting = deque(s for s in self._waiting if s.call.key not in dropped)
        self._running = [s for s in self._running if s.call.key not in dropped]

    @property
    def unfinished(self) -> int:
        return len(self._calls)

    # -- weights -------------------------------------------------------------------------------------------
    def load_weights(self, weights: WeightsInput, version: int) -> None:
        self._weights.update(dict(iter_weights(weights)))
        for sample in self._running:
            if sample.ids and version != self._version:
                sample.switches.append((len(sample.ids), version))
        self._version = version

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return dict(self._weights)
