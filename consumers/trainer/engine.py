"""The run's training engine, built from the run config."""
from __future__ import annotations

import torch

from streamrft.config import RunConfig
from streamrft.engines.training import TrainingEngine
from streamrft.engines.training.parallel import SingleProcess
from streamrft.model_paths import resolve_model_path


def build_engine(config: RunConfig, parallel: SingleProcess | None = None,
                 device: torch.device | str | None = None) -> TrainingEngine:
    """The run's training engine: its model in fp32 on ``device`` (default: ``trainer.device``), spread over
    the ranks by ``parallel`` when given."""
    if device is None and config.trainer.device != "auto":
        device = config.trainer.device
    return TrainingEngine.from_pretrained(resolve_model_path(config.model.path), config.training_settings,
                                          device=device, parallel=parallel, lora=config.model.lora)
