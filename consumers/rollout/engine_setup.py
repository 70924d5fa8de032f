"""What the rollout worker's engine and core are built from: the configured engine, the core's policy, and each
request's sampling settings."""
from __future__ import annotations

import zlib

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine, SamplingParams, create_engine
from streamrft.engines.precision import inference_dtype
from streamrft.engines.rollout import RolloutPolicy
from streamrft.model_paths import resolve_model_path
from streamrft.pacing import Pacing


def build_engine(config: RunConfig) -> InferenceEngine:
    """The configured engine; the common options (batch size, dtype, device) mapped onto each engine's names."""
    settings = config.rollout
    if settings.engine == "fake":
        return create_engine("fake", latency_s=settings.fake_latency_s)
    if settings.engine == "simulated":
        return create_engine("simulated", step_s=settings.simulated.step_s, min_tokens=settings.simulated.min_tokens,
                             max_num_seqs=settings.max_batch_size)
    if settings.engine == "openai":
        remote = settings.openai
        return create_engine("openai", resolve_model_path(config.model.path), base_url=remote.base_url,
                             model=remote.model, timeout_s=remote.timeout_s, max_concurrency=settings.max_batch_size,
                             api_key=remote.api_key.get_secret_value() if remote.api_key else None)
    kwargs = {"dtype": inference_dtype(config.model.dtype, settings.device), "device": settings.device}
    if settings.engine == "vllm":
        kwargs.update(settings.vllm.model_dump(), max_num_seqs=settings.max_batch_size,
                      in_flight_weights=settings.weight_update == "in_flight")
    else:
        kwargs["max_batch_size"] = settings.max_batch_size
    return create_engine(settings.engine, resolve_model_path(config.model.path), **kwargs)


def rollout_policy(config: RunConfig) -> RolloutPolicy:
    settings = config.rollout
    return RolloutPolicy(batching=settings.batching, requests_in_flight=settings.requests_in_flight,
                         requests_per_batch=settings.requests_per_batch,
                         follows_latest=Pacing.of(config).follows_latest,
                         max_version_wait_s=config.limits.max_version_wait_s, weight_update=settings.weight_update,
                         greedy_baseline=config.trainer.algorithm.greedy_baseline)


def request_sampling(sampling: SamplingParams, seed: int | None, request_id: str) -> SamplingParams:
    """With ``rollout.sampling.seed``, the request's own seed (sample j draws from it + j): the same samples
    whichever worker runs the request, whatever it is batched with."""
    if seed is None:
        return sampling
    return sampling.replace(seed=zlib.crc32(f"{seed}/{request_id}".encode()) << 8)  # room for 256 samples
