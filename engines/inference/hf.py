"""The transformers engine: CPU (the default here) or one GPU, batched over prompts x samples.

The decoding loop is written out rather than delegated to ``model.generate`` so that the engine controls, and
tests can check, exactly what RL needs: per-sample seeded sampling (a sample does not depend on what else is in
the batch), the logprob of every sampled token under the temperature-scaled policy (see ``base.py``), stop
strings, and finished rows leaving the batch. Prompts are left-padded; position ids follow the attention mask, so
a padded row computes the same numbers as the same row alone.
"""
from __future__ import annotations

import inspect
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models import MODEL_LOAD_LOCK
from .base import (
    Completion,
    EngineError,
    Finished,
    GenerationCall,
    InferenceEngine,
    Prompt,
    SamplingParams,
    WeightsInput,
    check_load,
    check_shapes,
    find_stop,
    iter_weights,
    per_prompt_params,
)

logger = logging.getLogger(__name__)



def _layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        resolved = getattr(torch, dtype)
    except AttributeError:
        resolved = None
    if not isinstance(resolved, torch.dtype):
        raise EngineError(f"unknown dtype {dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'")
    return resolved


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf; ``scaled`` is [rows, vocab], already
    divided by the temperature. At least one token per row always survives."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _most_likely(logprobs: torch.Tensor, count: int) -> list[dict[int, float]]:
    """Per row of ``logprobs`` ([rows, vocab]), {token id: logprob} of its ``count`` most likely tokens."""
    values, ids = logprobs.topk(min(count, logprobs.shape[-1]), dim=-1)
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@dataclass
class _Row:
    """One sample being decoded. ``listen(token, logprob)`` hears each token as it is sampled (streaming); when
    it answers False the row stops there."""

    prompt_ids: list[int]
    generator: torch.Generator | None
    listen: Callable[[int, float], bool | None] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] | None = None  # SamplingParams.top_logprobs
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs
    finish_reason: str | None = None
    stop_reason: str | None = None
    text: str | None = None


class TransformersEngine(InferenceEngine):
    """A Hugging Face causal LM served with a hand-written batched decoding loop.

    ``max_batch_size`` bounds the rows (prompts x n) decoded together; ``num_threads`` sets torch's intra-op
    threads (None leaves the process setting alone). fp32 on CPU by default, bf16 on CUDA.
    """

    kind = "transformers"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_batch_size: int = 64,
        num_threads: int | None = None,
        attn_implementation: str | None = "sdpa",
        version: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.model_path = str(model_path)
        started = time.monotonic()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            kwargs: dict[str, Any] = {"dtype": self.dtype}
            if attn_implementation:
                kwargs["attn_implementation"] = attn_implementation
            with MODEL_LOAD_LOCK:
                self.model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs).to(self.device)
        except OSError as exc:
            raise EngineError(f"cannot load a model from {self.model_path!r}: {exc}") from exc
        self.model.eval()
        self.max_model_len = getattr(self.model.config, "max_position_embeddings", None)
        # transformers renamed forward arguments across versions; resolve the spelling once
        accepted = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in accepted), None)
        self.tokenizer.padding_side = "left"
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self._version = version
        logger.info(
            "transformers engine: %s on %s/%s in %.1f s",
            self.model_path, self.device, str(self.dtype).removeprefix("torch."), time.monotonic() - started,
        )

    # -- generation ----------------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams], n: int = 1
    ) -> list[list[Completion]]:
        return self._generate(prompts, params, n)

    def _generate_for(self, calls: list[GenerationCall], n: int) -> list[Finished]:
        """Submitted calls in one batch; a call's listener hears each token as it is decoded."""
        listeners = [self._listener(call.on_tokens, i) if call.on_tokens else None
                     for call in calls for i in range(len(call.prompts))]
        outputs = self._generate([p for call in calls for p in call.prompts],
                                 [p for call in calls for p in call.params], n, listeners)
        finished, start = [], 0
        for call in calls:
            finished.append((call.key, outputs[start : start + len(call.prompts)]))
            start += len(call.prompts)
        return finished

    @staticmethod
    def _listener(on_tokens, prompt_index: int) -> Callable[[int], Callable[[int, float], bool | None]]:
        return lambda sample: lambda token, logprob: on_tokens(prompt_index, sample, [token], [logprob])

    def _generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams], n: int,
                  listeners: Sequence | None = None) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        rows: list[_Row] = []
        # rows that differ only in their seed are decoded together
        batches: dict[SamplingParams, list[_Row]] = {}
        for i, (prompt, sample_params) in enumerate(zip(prompts, per_prompt_params(params, len(prompts)))):
            ids = self.prompt_ids(prompt)
            if self.max_model_len is not None and len(ids) >= self.max_model_len:
                raise EngineError(f"a prompt of {len(ids)} tokens leaves no room in the model's "
                                  f"{self.max_model_len} positions")
            if sample_params.json_schema is not None:
                raise EngineError("the transformers engine has no guided decoding (json_schema); use the vllm "
                                  "engine")
            prompt_logprobs = None if sample_params.prompt_logprobs is None else self._prompt_logprobs(
                ids, sample_params.prompt_logprobs, sample_params.logprob_temperature)
            listener = listeners[i] if listeners else None
            for j in range(n):
                row = _Row(prompt_ids=ids, generator=self._generator(sample_params, j),
                           listen=listener(j) if listener else None, prompt_logprobs=prompt_logprobs)
                rows.append(row)
                batches.setdefault(sample_params.replace(seed=None), []).append(row)
        for shared, batch in batches.items():
            for start in range(0, len(batch), self.max_batch_size):
                self._decode(batch[start : start + self.max_batch_size], shared)
        completions = [self._completion(row) for row in rows]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.sample_seed(index)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(secrets.randbits(63) if seed is None else seed)
        return generator

    @torch.inference_mode()
    def _decode(self, rows: list[_Row], params: SamplingParams) -> None:
        """Decode ``rows`` together until each has finished; fills their response fields in place."""
        device = self.device
        longest = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, longest - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            attention[i, longest - len(row.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        active = list(range(len(rows)))  # rows still decoding, in batch order
        out, cache = self._forward(input_ids, attention, positions, None)
        next_position = positions[:, -1:] + 1
        temperature = params.logprob_temperature
        eos = self.tokenizer.eos_token_id

        for step in range(params.max_tokens):
            logits = out.logits[:, -1, :].float()
            scaled = logits / temperature
            logprobs = torch.log_softmax(scaled, dim=-1)
            tokens = self._choose(scaled, params, [rows[i] for i in active])
            chosen_logprobs = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
            tokens_list = tokens.tolist()
            tops = _most_likely(logprobs, params.top_logprobs) if params.top_logprobs else None

            keep = []
            for b, i in enumerate(active):
                row = rows[i]
                row.response_ids.append(tokens_list[b])
                row.logprobs.append(chosen_logprobs[b])
                if tops is not None:
                    row.top = (row.top or []) + [{**tops[b], tokens_list[b]: chosen_logprobs[b]}]
                if row.listen is not None and row.listen(tokens_list[b], chosen_logprobs[b]) is False:
                    row.finish_reason = "length"  # nobody wants the rest
                elif tokens_list[b] == eos:
                    row.finish_reason = "stop"
                elif params.stop and self._check_stop(row, params.stop):
                    pass
                elif len(row.response_ids) >= params.max_tokens or self._at_model_len(row):
                    row.finish_reason = "length"
                else:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):  # finished rows leave the batch
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                tokens, attention, next_position = tokens[index], attention[index], next_position[index]
                active = [active[b] for b in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=-1)
            out, cache = self._forward(tokens[:, None], attention, next_position, cache)
            next_position = next_position + 1

    @torch.inference_mode()
    def _prompt_logprobs(self, ids: list[int], alternatives: int, temperature: float) -> list[dict[int, float] | None]:
        """Each prompt token's logprob given the tokens before it (one forward pass over the prompt), with the
        ``alternatives`` most likely tokens at its position; None for the first token."""
        if len(ids) < 2:
            return [None] * len(ids)
        inputs = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        own = logprobs.gather(-1, inputs[0, 1:, None])[:, 0].tolist()
        tops = _most_likely(logprobs, alternatives) if alternatives else [{} for _ in own]
        return [None] + [{**top, token: lp} for top, token, lp in zip(tops, ids[1:], own)]

    def _at_model_len(self, row: _Row) -> bool:
        return self.max_model_len is not None and len(row.prompt_ids) + len(row.response_ids) >= self.max_model_len

    def _forward(self, input_ids, attention, positions, cache):
        """One forward pass that keeps only the last position's logits; returns (output, cache)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions, "use_cache": True}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if self._keep_arg:
            kwargs[self._keep_arg] = 1
        out = self.model(**kwargs)
        return out, getattr(out, self._cache_arg)

    def _choose(self, scaled: torch.Tensor, params: SamplingParams, rows: list[_Row]) -> torch.Tensor:
        if params.greedy:
            return scaled.argmax(dim=-1)
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        picks = [torch.multinomial(probs[b], 1, generator=row.generator) for b, row in enumerate(rows)]
        return torch.cat(picks)

    def _check_stop(self, row: _Row, stops: tuple[str, ...]) -> bool:
        text = self.decode(row.response_ids)
        found = find_stop(text, stops)
        if found is None:
            return False
        row.finish_reason, row.stop_reason, row.text = "stop", found[1], text[: found[0]]
        return True

    def _completion(self, row: _Row) -> Completion:
        text = row.text if row.text is not None else self.decode(row.response_ids)
        return Completion(
            prompt_ids=row.prompt_ids,
            response_ids=row.response_ids,
            logprobs=row.logprobs,
            text=text,
            finish_reason=row.finish_reason or "length",
            model_version=self._version,
            stop_reason=row.stop_reason,
            top_logprobs=row.top,
            prompt_logprobs=row.prompt_logprobs,
        )

    # -- weights -------------------------------------------------------------------------------------------

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        return named

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        check_shapes(_layout_of(self._named_tensors()), shapes)

    @torch.no_grad()
    def load_weights(self, weights: WeightsInput, version: int) -> None:
        targets = self._named_tensors()
        pending = list(iter_weights(weights))
        check_load(_layout_of(targets), pending)
        for name, tensor in pending:
            targets[name].copy_(tensor.to(device=self.device, dtype=targets[name].dtype))
        self._version = version
        logger.debug("loaded %d tensors, now version %d", len(pending), version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
