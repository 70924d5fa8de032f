"""``rollout.engine: auto``: vLLM where it is installed, else transformers, with one line that says how to get vLLM.

Settled when the config loads, so every check that depends on the engine (sampling options vLLM refuses, GPU
shares) sees the engine that will run."""
from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)


def resolve_auto_engine() -> str:
    if importlib.util.find_spec("vllm") is not None:
        return "vllm"
    logger.warning("rollout.engine auto: vLLM is not installed, rolling out with transformers "
                   "(`scripts/setup.sh --vllm` installs it)")
    return "transformers"
