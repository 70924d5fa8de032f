"""Auxiliary models beside the rollout model, and their two users: the ``judge`` reward and distillation.

``auxiliary_models`` names models (``{name: {engine, model, ...}}``) that every rollout worker starts next to its
rollout engine -- or reaches by URL (``engine: openai``) -- and gives its workflows and rewards by name
(``streamrft/engines/workflows/auxiliary.py``). ``judge`` says how the ``judge`` reward asks one of them for a
score; ``distillation.teacher`` names the one whose logprobs of every sampled token the workers store with the
experience, for ``trainer.algorithm.advantage: distill`` or ``distill_coef``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from streamrft.engines.settings.judge import JudgeSettings

from .base import Section
from .roles import VLLMConfig


class AuxiliaryModelConfig(Section):
    """One auxiliary model. ``transformers`` and ``vllm`` load ``model`` (a local model directory, or
    ``smollm2-135m``) in the worker's process; ``openai`` reaches an OpenAI-compatible endpoint at ``base_url``
    that serves ``model`` (an id), and needs a local ``tokenizer`` directory only for its token bookkeeping
    (default: the policy's, ``model.path``)."""

    engine: Literal["transformers", "vllm", "openai"] = Field(
        default="transformers", description="transformers or vllm: loaded in each rollout worker's process; "
                                            "openai: an OpenAI-compatible endpoint at base_url")
    model: str = Field(min_length=1, description="a model directory; engine openai: the id the endpoint serves")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the weights' dtype (transformers, vllm); auto = the checkpoint's own")
    device: str = Field(default="auto", description="transformers: its torch device; vllm: auto or the build's")
    max_batch_size: int = Field(default=32, ge=1, description="sequences generated together (vLLM: max_num_seqs; "
                                                             "openai: concurrent requests)")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig,
                             description="engine vllm's own options; beside a vLLM rollout engine on one GPU, "
                                         "give each its share of gpu_memory_utilization")
    base_url: str = Field(default="", description="engine openai: the endpoint, e.g. http://host:8000/v1")
    api_key: SecretStr | None = Field(default=None, description="engine openai: sent as a bearer token "
                                                                "(STREAMRFT_AUXILIARY_MODELS__<NAME>__API_KEY)")
    timeout_s: float = Field(default=120.0, gt=0, description="engine openai: per HTTP request")
    tokenizer: str = Field(default="", description="engine openai: a local tokenizer directory; default "
                                                   "model.path")

    @model_validator(mode="after")
    def _reachable(self) -> "AuxiliaryModelConfig":
        if self.engine == "openai" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError("engine openai needs base_url (http(s)://host:port/v1) and model (the id the "
                             "endpoint serves)")
        if self.engine != "openai" and (self.base_url or self.api_key is not None):
            raise ValueError(f"base_url and api_key are for engine openai; engine {self.engine} loads model "
                             "in the worker")
        return self


class JudgeConfig(JudgeSettings, Section):
    """``judge``: how ``reward_fn: judge`` asks ``model`` (an entry of ``auxiliary_models``) for a score. Every key
    is declared once, in :class:`streamrft.engines.settings.judge.JudgeSettings`."""


class DistillationConfig(Section):
    """``distillation``: on-policy distillation from a teacher (an entry of ``auxiliary_models`` with the
    policy's tokenizer)."""

    teacher: str | None = Field(default=None, description="the auxiliary model whose logprobs of each sampled "
                                                          "token are stored in the experience")


def check_auxiliary(models: dict[str, AuxiliaryModelConfig], judge: JudgeConfig | None,
                    distillation: DistillationConfig, rollout_engine: str, rollout_gpu_share: float,
                    uses_teacher: bool) -> None:
    """The cross-field checks of the run config, with how to fix each (ValueError)."""
    have = ", ".join(sorted(models)) or "none"
    if judge is not None and judge.model not in models:
        raise ValueError(f"judge.model {judge.model!r} is not one of auxiliary_models ({have}); add it there or "
                         "name one of them")
    teacher = distillation.teacher
    if teacher is not None and teacher not in models:
        raise ValueError(f"distillation.teacher {teacher!r} is not one of auxiliary_models ({have}); add it "
                         "there or name one of them")
    if teacher is not None and models[teacher].engine != "transformers":
        raise ValueError(f"distillation.teacher {teacher!r} has engine {models[teacher].engine}: a teacher "
                         "scores the student's tokens by teacher forcing, which streamrft does with engine "
                         "transformers; set auxiliary_models." f"{teacher}.engine: transformers")
    if uses_teacher and teacher is None:
        raise ValueError("trainer.algorithm.advantage: distill (or distill_coef > 0) trains on a teacher's "
                         "logprobs; set distillation.teacher to one of auxiliary_models, whose logprobs the "
                         "rollout workers then store with every experience")
    shares = [("rollout.vllm", rollout_gpu_share)] if rollout_engine == "vllm" else []
    shares += [(f"auxiliary_models.{name}.vllm", m.vllm.gpu_memory_utilization) for name, m in models.items()
               if m.engine == "vllm"]
    if len(shares) > 1 and sum(share for _, share in shares) > 1.0:
        listed = " + ".join(f"{where}.gpu_memory_utilization ({share:g})" for where, share in shares)
        raise ValueError(f"{listed} is more than the whole GPU: the vLLM engines of a worker share its GPU; "
                         "give each its share (e.g. 0.5 for the rollout engine, 0.3 for a judge)")
