"""On-policy distillation in the training step: the teacher's logprobs the batch carries (``Experience.
teacher_logprobs``, written by rollout workers that have a teacher), handed to the advantage functions that
declare them (``distill``, :mod:`streamrft.engines.algorithms.advantages`), and the ``distill/*`` metrics."""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .batch import Batch
from ..settings.training import OPTIONAL_ADVANTAGE_INPUTS


def keep_rows_with_teacher(batch: Batch) -> int:
    """Take the rows that carry no teacher logprobs out of the loss (their response mask is zeroed: a
    distillation step has nothing to compare them with, and a 0 in their place would be a made-up target);
    returns how many rows that was."""
    if batch.teacher_logprobs is None:
        batch.teacher_logprobs = torch.zeros_like(batch.behaviour_logprobs)
        batch.has_teacher = torch.zeros(len(batch), dtype=torch.bool, device=batch.behaviour_logprobs.device)
    batch.response_mask = batch.response_mask * batch.has_teacher.to(batch.response_mask.dtype)[:, None]
    return int((~batch.has_teacher).sum())


def teacher_inputs(advantage_fn: Callable, batch: Batch) -> dict[str, torch.Tensor]:
    """The per-token inputs of :data:`OPTIONAL_ADVANTAGE_INPUTS` that ``advantage_fn`` declares, from ``batch``
    (after :func:`keep_rows_with_teacher` when it wants the teacher's)."""
    available = {"teacher_logprobs": batch.teacher_logprobs, "behaviour_logprobs": batch.behaviour_logprobs}
    declared = inspect.signature(advantage_fn).parameters
    return {name: available[name] for name in OPTIONAL_ADVANTAGE_INPUTS if name in declared}


def distill_metrics(batch: Batch, mask: torch.Tensor) -> dict[str, float]:
    """``distill/kl``: the mean over trained tokens of ``logp_behav − logp_teacher``, the one-sample estimate of
    the reverse KL ``KL(π‖π_teacher)`` per token that distillation lowers; ``distill/teacher_rows``: rows with a
    teacher's logprobs. Empty when no row carries any."""
    if batch.teacher_logprobs is None or batch.has_teacher is None or not bool(batch.has_teacher.any()):
        return {}
    m = mask * batch.has_teacher.to(mask.dtype)[:, None]
    gap = (batch.behaviour_logprobs - batch.teacher_logprobs) * m
    return {"distill/kl": float(gap.sum() / m.sum().clamp(min=1)),
            "distill/teacher_rows": float(batch.has_teacher.sum())}
