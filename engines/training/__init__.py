"""The torch training engine (no Kafka): collate experiences, per-token logprobs, loss, optimiser step."""
from .batch import Batch, collate
from .engine import TrainingEngine, default_device
from .logprobs import entropy_from_logprobs, response_logprobs
from .schedule import build_scheduler, lr_factor
from ..settings.training import AlgorithmSettings, OptimizerSettings, TrainingSettings

__all__ = [name for name in dir() if not name.startswith("_")]
