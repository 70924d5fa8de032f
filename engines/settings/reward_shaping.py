"""Reward shaping applied by the rollout worker to a training request's rewards before its experiences are written
(``rollout.overlong_penalty``): settings only, no torch. The shaping itself is
:mod:`streamrft.engines.rollout.reward_shaping`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class OverlongPenalty(BaseModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, Eq. 13): no penalty up to
    ``max_tokens − buffer_len`` response tokens, then a linear one down to ``−penalty_factor`` at ``max_tokens``
    (``rollout.sampling.max_tokens``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    buffer_len: int = Field(ge=1, description="L_cache: the last this many tokens before max_tokens are punished "
                                              "linearly (must not exceed rollout.sampling.max_tokens)")
    penalty_factor: float = Field(default=1.0, ge=0, description="the penalty at max_tokens (veRL "
                                                                 "overlong_penalty_factor); 0 = off")
