"""The inference-engine interface: what a rollout worker and a workflow may ask of any engine.

An engine generates ``n`` samples for each of several prompts in one call (so a batching backend such as vLLM
sees the whole batch), returns the exact token ids it sampled with one logprob per sampled token, and accepts
new weights in place between calls.

**Which logprob.** ``Completion.logprobs[i]`` is ``log_softmax(logits / T)[token_i]`` computed in fp32 from the
model's raw logits at that position, where ``T = SamplingParams.logprob_temperature`` (the sampling temperature,
or 1.0 for greedy decoding). top-k / top-p truncation is *not* applied: the value is the log-probability of the
token under the temperature-scaled policy, which is what a trainer recomputes with a teacher-forced forward pass
(``log_softmax(logits / T)`` over the same tokens) for importance ratios. Tests hold engines to that equality.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

if TYPE_CHECKING:
    import torch

Message = Mapping[str, str]  # {"role": ..., "content": ...}
# A prompt is either chat messages (the engine applies the model's chat template) or token ids, used as given.
Prompt = Union[Sequence[Message], Sequence[int]]
FinishReason = Literal["stop", "length"]
WeightsInput = Union[Mapping[str, "torch.Tensor"], Iterable[tuple[str, "torch.Tensor"]]]


class EngineError(RuntimeError):
    """An engine cannot be built or cannot serve a request; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p >= 1`` switch those
    filters off. ``seed`` makes sampling reproducible: sample ``j`` of a prompt draws from a generator seeded
    with ``seed + j`` whatever else is in the batch. ``stop`` strings end a sample (as does the EOS token); the
    token that completes a stop string is kept in the token ids (it was sampled), the text is cut before it.

    What a client of the served API may ask for besides the samples: ``top_logprobs`` alternatives at each
    response position (``Completion.top_logprobs``), the prompt's own logprobs with ``prompt_logprobs``
    alternatives (``Completion.prompt_logprobs``; None: not computed), and ``json_schema``, the JSON text of a
    schema the response must match (guided decoding, only where ``InferenceEngine.structured_outputs``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.top_logprobs < 0 or (self.prompt_logprobs is not None and self.prompt_logprobs < 0):
            raise ValueError(f"top_logprobs and prompt_logprobs must be >= 0, got {self.top_logprobs}, "
                             f"{self.prompt_logprobs}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The ``T`` in ``log_softmax(logits / T)`` of the returned logprobs (see the module docstring)."""
        return 1.0 if self.greedy else self.temperature

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def sample_seed(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index


@dataclass(slots=True)
class Completion:
    """One sample. ``response_ids`` are exactly the sampled tokens (an EOS token that ended the sample is
    included: the policy chose it); ``logprobs`` has one entry per response token; ``text`` is the decoded
    response without special tokens, cut before a matched stop string."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    model_version: int  # the weights its first token came from (the oldest, when it spans several)
    # the stop string that ended the sample, if one did
    stop_reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # new weights loaded while the sample was being generated (InferenceEngine.loads_in_flight): (index of the
    # first response token of a version, that version), oldest first; empty when one version made it all
    version_switches: list[tuple[int, int]] = field(default_factory=list)
    # SamplingParams.top_logprobs > 0: per response token, {token id: logprob} of the most likely tokens and the
    # sampled one (under the same temperature-scaled policy as ``logprobs``)
    top_logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs set: per prompt token, {token id: logprob} of that token and the most likely
    # ones given the tokens before it; None for the first token, which has nothing before it
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def last_version(self) -> int:
        """The weights its last token came from."""
        return self.version_switches[-1][1] if self.version_switches else self.model_version

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def ended_with_eos(self) -> bool:
        return self.finish_reason == "stop" and self.stop_reason is None


# on_tokens(prompt_index, sample_index, token_ids, logprobs): the tokens a call's sample gained since the last
# call (called on the thread that steps the engine); every sample's tokens add up to its Completion's. A
# listener that answers False wants no more of that sample: an engine that can stops it there (the transformers
# engine drops the row from its batch at once; vLLM's calls are aborted between its short steps anyway).
TokenListener = Callable[[int, int, list[int], list[float]], "bool | None"]


@dataclass(slots=True)
class GenerationCall:
    """One ``generate`` call handed to :meth:`InferenceEngine.submit`, under the caller's key."""

    key: Hashable
    prompts: list[Prompt]
    params: list[SamplingParams]
    n: int
    on_tokens: TokenListener | None = None


# what a step hands back for a finished call: its key and result[i][j], or the exception it failed with
Finished = tuple[Hashable, Union[list[list[Completion]], BaseException]]


def iter_weights(weights: WeightsInput) -> Iterable[tuple[str, "torch.Tensor"]]:
    return weights.items() if isinstance(weights, Mapping) else weights


class InferenceEngine(ABC):
    """Base of all engines. Not thread-safe: one caller at a time (a worker owns its engine).

    Subclasses set ``self.tokenizer`` (a Hugging Face tokenizer) and ``self._version``, and implement
    :meth:`generate`, :meth:`load_weights` and :meth:`state_dict`.
    """

    kind: str = "base"
    tokenizer: Any
    _version: int = 0
    # The longest sequence (prompt + response tokens) the engine serves, None when it does not say: a sample
    # stops there ("length"), as vLLM's do at its max_model_len, so no sequence outgrows the model's positions.
    max_model_len: int | None = None
    # True when the engine honours SamplingParams.json_schema (guided decoding); others refuse it
    structured_outputs: bool = False

    # -- generation ----------------------------------------------------------------------------------------

    @abstractmethod
    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams], n: int = 1
    ) -> list[list[Completion]]:
        """``n`` samples for each prompt: ``result[i][j]`` is sample ``j`` of ``prompts[i]``. ``params`` is one
        SamplingParams for all prompts or one per prompt (e.g. a seed per trajectory in a multi-turn
        workflow)."""

    def generate_one(self, prompt: Prompt, params: SamplingParams, n: int = 1) -> list[Completion]:
        return self.generate([prompt], params, n)[0]

    # -- submitted calls (what a scheduler drives: continuous batching) --------------------------------------

    incremental: bool = False
    """True when :meth:`step` advances the submitted calls by a token or so (vLLM), so that new calls join the
    running batch between steps; False when one step runs every submitted call to its end (one ``generate``)."""

    loads_in_flight: bool = False
    """True when :meth:`load_weights` may run between steps while calls are unfinished: their next tokens come
    from the new weights, and their completions say from which token (``Completion.version_switches``). An
    engine that cannot refuses such a load (RuntimeError). A batch engine has no unfinished call between steps
    and loads there as it is."""

    def submit(self, key: Hashable, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
               n: int = 1, on_tokens: TokenListener | None = None) -> None:
        """Queue a ``generate`` call under ``key`` (unique among unfinished calls); a later :meth:`step` hands
        back its result. ``on_tokens`` hears each sample's tokens as the engine produces them (streaming): an
        incremental engine calls it at every step, a batch engine when it can (this default: once per sample,
        when the call is done)."""
        self._submitted().append(GenerationCall(key, list(prompts), per_prompt_params(params, len(prompts)), n,
                                                on_tokens))

    def step(self) -> list[Finished]:
        """Advance the submitted calls and hand back those that finished. A call that fails fails alone: its
        exception is its result. This default runs them all in one ``generate`` per distinct ``n``; when such a
        combined call raises, each call runs again alone, so the call whose prompts break the engine is found."""
        calls, self._calls = self._submitted(), []
        finished: list[Finished] = []
        for n in sorted({call.n for call in calls}):
            group = [call for call in calls if call.n == n]
            try:
                finished += self._generate_for(group, n)
            except Exception:
                if len(group) == 1:
                    finished.append((group[0].key, sys.exc_info()[1]))
                    continue
                for call in group:
                    try:
                        finished += self._generate_for([call], n)
                    except Exception as exc:
                        finished.append((call.key, exc))
        return finished

    def abort(self, keys: Iterable[Hashable]) -> None:
        """Drop submitted calls that have not finished; nothing is handed back for them."""
        dropped = set(keys)
        self._calls = [call for call in self._submitted() if call.key not in dropped]

    @property
    def unfinished(self) -> int:
        """Submitted calls not handed back yet."""
        return len(self._submitted())

    def _submitted(self) -> list[GenerationCall]:
        if "_calls" not in self.__dict__:
            self._calls: list[GenerationCall] = []
        return self._calls

    def _generate_for(self, calls: list[GenerationCall], n: int) -> list[Finished]:
        outputs = self.generate([p for call in calls for p in call.prompts],
                                [p for call in calls for p in call.params], n)
        finished, start = [], 0
        for call in calls:
            result = outputs[start : start + len(call.prompts)]
            announce_whole(call, result)
            finished.append((call.key, result))
            start += len(call.prompts)
        return finished

    # -- weights -------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The model version the engine serves; 0 for the weights it was built with."""
        return self._version

    @abstractmethod
    def load_weights(self, weights: WeightsInput, version: int) -> None:
        """Copy ``weights`` (Hugging Face parameter names; a subset is allowed, e.g. one bucket of a broadcast)
        into the model in place and set :attr:`version`. Unknown names or wrong shapes raise ``ValueError``
        before anything is changed."""

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise ``ValueError`` if weights of these names and shapes would be refused by :meth:`load_weights`,
        so a caller can refuse a published version before fetching it. Engines that cannot tell without loading
        (this default) accept everything here and rely on ``load_weights``'s own check."""

    @abstractmethod
    def state_dict(self) -> dict[str, "torch.Tensor"]:
        """The served weights by Hugging Face parameter name (for tests and checks, may be views)."""

    def close(self) -> None:
        """Release the model and any worker processes."""

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tokenizer helpers (shared by every engine that has a Hugging Face tokenizer) ------------------------

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold are below this: the tokenizer's ids, which the model's embeddings cover."""
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS added (special-token strings inside are recognised)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template's text of ``messages``; ``tools`` (OpenAI function descriptions) go to the template,
        which shows them to the model if it knows how."""
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: chat messages through the chat template, token ids as they are."""
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        first = prompt[0]
        if isinstance(first, Mapping):
            return self.encode(self.render_chat(prompt))  # type: ignore[arg-type]
        if isinstance(first, int) or hasattr(first, "__index__"):
            return [int(t) for t in prompt]  # type: ignore[union-attr]
        raise TypeError(f"a prompt is chat messages or token ids, got a sequence of {type(first).__name__}")


# name -> (shape, dtype) of the tensors an engine serves: what a load is checked against
Layout = Mapping[str, tuple[tuple[int, ...], Any]]


def dtype_kind(dtype: Any) -> str:
    """float / complex / bool / int: a load may convert within a kind (bf16 -> fp32), not across kinds."""
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if str(dtype) == "torch.bool" else "int"


def check_shapes(layout: Layout, shapes: Mapping[str, Sequence[int]]) -> None:
    """ValueError unless every name is in ``layout`` with that shape (``InferenceEngine.check_weights``)."""
    unknown = [name for name in shapes if name not in layout]
    if unknown:
        raise ValueError(f"unknown parameter names (first 5 of {len(unknown)}): {unknown[:5]}")
    wrong = [f"{name}: {tuple(shape)} != {tuple(layout[name][0])}" for name, shape in shapes.items()
             if tuple(shape) != tuple(layout[name][0])]
    if wrong:
        raise ValueError(f"shape mismatch: {wrong[:5]}")


def check_load(layout: Layout, pending: Sequence[tuple[str, "torch.Tensor"]]) -> None:
    """Everything for which a load is refused, checked before the first copy so a refused load keeps the old
    weights: a name twice, unknown names, other shapes, a dtype of another kind."""
    if len({name for name, _ in pending}) != len(pending):
        raise ValueError("the same parameter name twice in one load")
    check_shapes(layout, {name: tuple(t.shape) for name, t in pending})
    unconvertible = [f"{name}: {t.dtype} -> {layout[name][1]}" for name, t in pending
                     if dtype_kind(t.dtype) != dtype_kind(layout[name][1])]
    if unconvertible:
        raise ValueError(f"dtype of another kind (first 5): {unconvertible[:5]}")


def announce_whole(call: GenerationCall, result: list[list[Completion]]) -> None:
    """Tell a call's listener each sample whole (what an engine that cannot stream does once a call is done)."""
    if call.on_tokens is None:
        return
    for i, samples in enumerate(result):
        for j, completion in enumerate(samples):
            call.on_tokens(i, j, list(completion.response_ids), list(completion.logprobs))


def per_prompt_params(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt, from one shared or a sequence of ``count``."""
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in ``text``: (index, stop) or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best
