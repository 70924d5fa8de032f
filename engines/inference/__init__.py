"""Inference engines behind one interface (``base.InferenceEngine``), built by name with :func:`create_engine`.

============== ==================================================== ==========================================
kind           class                                                 where
============== ==================================================== ==========================================
transformers   :class:`~.hf.TransformersEngine`                      CPU (default here) or one GPU
vllm           :class:`~.vllm.VLLMEngine`                            one CUDA GPU with vllm installed
fake           :class:`~.fake.FakeEngine`                            no model: fixed latency, scripted tokens
simulated      :class:`~.simulated.SimulatedEngine`                  no model: decodes in batches as vLLM does
============== ==================================================== ==========================================

Engine modules are imported when first built, so importing this package costs nothing and needs no torch.
"""
from __future__ import annotations

import importlib
import os
from typing import Any

from .base import (
    Completion,
    EngineError,
    FinishReason,
    InferenceEngine,
    Message,
    Prompt,
    SamplingParams,
    WeightsInput,
)

# kind -> "module:Class" inside this package
ENGINES: dict[str, str] = {
    "transformers": "hf:TransformersEngine",
    "vllm": "vllm:VLLMEngine",
    "fake": "fake:FakeEngine",
    "simulated": "simulated:SimulatedEngine",
    "openai": "openai_api:OpenAIEngine",
}


def engine_class(kind: str) -> type[InferenceEngine]:
    try:
        target = ENGINES[kind]
    except KeyError:
        raise EngineError(f"unknown inference engine {kind!r}; choose one of {sorted(ENGINES)}") from None
    module_name, class_name = target.split(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)


def create_engine(kind: str, model_path: str | os.PathLike | None = None, **kwargs: Any) -> InferenceEngine:
    """Build the engine ``kind`` for the model directory ``model_path``; ``kwargs`` go to its constructor
    (e.g. ``device``, ``dtype``, ``max_batch_size`` for transformers; ``latency_s`` for fake)."""
    cls = engine_class(kind)
    if model_path is None and kind not in ("fake", "simulated"):
        raise EngineError(f"the {kind} engine needs a model path")
    return cls(model_path, **kwargs)


__all__ = [
    "ENGINES",
    "Completion",
    "EngineError",
    "FinishReason",
    "InferenceEngine",
    "Message",
    "Prompt",
    "SamplingParams",
    "WeightsInput",
    "create_engine",
    "engine_class",
]
