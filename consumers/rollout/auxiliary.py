"""The rollout worker's auxiliary models (``auxiliary_models``): built from the run config here, so the workflow
layer gets engines by name and never reads config (``engines/workflows/auxiliary.py`` says how they are called
and batched)."""
from __future__ import annotations

import logging

from streamrft.config import RunConfig
from streamrft.config.auxiliary import AuxiliaryModelConfig
from streamrft.engines.inference import EngineError, InferenceEngine, create_engine
from streamrft.engines.workflows.teacher import check_same_tokenizer
from streamrft.errors import ConfigError
from streamrft.model_paths import resolve_model_path


logger = logging.getLogger(__name__)


def build_auxiliary_engine(name: str, settings: AuxiliaryModelConfig, policy_path: str) -> InferenceEngine:
    """One auxiliary model's engine, its options mapped onto the engine's names as for the rollout engine."""
    key = f"auxiliary_models.{name}"
    if settings.engine == "openai":
        # the endpoint's ids are its own; the local tokenizer only counts tokens: the policy's, unless named
        tokenizer = (resolve_model_path(settings.tokenizer, f"{key}.tokenizer") if settings.tokenizer
                     else resolve_model_path(policy_path))
        return create_engine("openai", tokenizer, base_url=settings.base_url, model=settings.model,
                             timeout_s=settings.timeout_s, max_concurrency=settings.max_batch_size,
                             api_key=settings.api_key.get_secret_value() if settings.api_key else None)
    path = resolve_model_path(settings.model, f"{key}.model")
    if settings.engine == "vllm":
        return create_engine("vllm", path, dtype=settings.dtype, device=settings.device,
                             max_num_seqs=settings.max_batch_size, **settings.vllm.model_dump())
    return create_engine("transformers", path, dtype=settings.dtype, device=settings.device,
                         max_batch_size=settings.max_batch_size)


def build_auxiliary(config: RunConfig, policy: InferenceEngine) -> dict[str, InferenceEngine]:
    """Every auxiliary model of the run, started (or reached) now; the teacher's tokenizer is checked against
    ``policy``'s, so a teacher that cannot score the student's tokens is refused at start. On any failure the
    engines already built are closed."""
    engines: dict[str, InferenceEngine] = {}
    try:
        for name, settings in config.auxiliary_models.items():
            engines[name] = build_auxiliary_engine(name, settings, config.model.path)
            logger.info("auxiliary model %r: %s engine on %s", name, settings.engine, settings.model)
        teacher = config.distillation.teacher
        if teacher is not None:
            try:
                check_same_tokenizer(policy.tokenizer, engines[teacher].tokenizer, teacher)
            except EngineError as exc:
                raise ConfigError(f"distillation.teacher: {exc}") from None
    except (ConfigError, EngineError):
        close_all(engines)
        raise
    return engines


def close_all(engines: dict[str, InferenceEngine]) -> None:
    for name, engine in engines.items():
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - closing the others matters more
            logger.exception("auxiliary model %r did not close cleanly", name)
