"""Reward shaping of a training request's samples, applied by the worker before its experiences and result are
assembled (:func:`~.assembly.assemble`), so the experience's ``reward``, the result's reward statistics and
dynamic sampling's count all see the shaped reward. Eval requests are not shaped: their metrics measure the task's
own reward."""
from __future__ import annotations

from dataclasses import dataclass

from ..settings.reward_shaping import OverlongPenalty
from ..workflows.base import WorkflowSample

PENALTY_METRIC = "overlong_penalty"  # the sample's penalty, in its experience's ``metrics``


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, penalty_factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, Eq. 13), scaled by ``penalty_factor``::

        R(y) = 0                                  if |y| ≤ L_max − L_cache
             = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
             = −1                                 if |y| > L_max

    with ``|y| = length``, ``L_max = max_tokens``, ``L_cache = buffer_len``: 0, then linear down to −1 at
    ``max_tokens``."""
    expected = max_tokens - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_tokens:
        return penalty_factor * (expected - length) / buffer_len
    return -penalty_factor


@dataclass(frozen=True)
class OverlongShaping:
    """``rollout.overlong_penalty`` with the run's ``max_tokens``. A sample's length is the tokens the policy
    generated (its action mask's ones: a multi-turn episode's environment tokens are not its answer)."""

    settings: OverlongPenalty
    max_tokens: int

    def __post_init__(self) -> None:
        if self.settings.buffer_len > self.max_tokens:
            raise ValueError(f"overlong_penalty.buffer_len ({self.settings.buffer_len}) must not exceed max_tokens "
                             f"({self.max_tokens})")

    def apply(self, samples: list[WorkflowSample]) -> list[float]:
        """Add each sample's penalty to its reward (and record it in its metrics); the penalties, in order."""
        penalties = []
        for sample in samples:
            length = sum(sample.action_mask) if sample.action_mask is not None else sample.response_length
            penalty = overlong_penalty(length, self.max_tokens, self.settings.buffer_len,
                                       self.settings.penalty_factor)
            sample.reward += penalty
            sample.metrics[PENALTY_METRIC] = penalty
            penalties.append(penalty)
        return penalties
