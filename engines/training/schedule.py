"""Learning-rate schedules as multipliers of the base lr, by optimiser step (0-based)."""
from __future__ import annotations

import math

import torch

from ..settings.training import TrainingSettings


def lr_factor(step: int, settings: TrainingSettings) -> float:
    """Multiplier of ``lr`` for optimiser step ``step``.

    * warm-up (both schedules): ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` — the first step
      already moves (a factor of 0 would waste it);
    * ``constant``: 1 afterwards;
    * ``warmup_cosine``: with ``p = (step − warmup) / (total − warmup)`` clamped to [0, 1],
      ``min_lr_ratio + (1 − min_lr_ratio) · ½ (1 + cos(π p))``.
    """
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.lr_schedule == "constant":
        return 1.0
    span = settings.total_steps - settings.warmup_steps
    progress = min(max((step - settings.warmup_steps) / span, 0.0), 1.0)
    return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, settings: TrainingSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_factor`; its state_dict holds only the step (the schedule comes from settings)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings))
