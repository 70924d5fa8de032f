"""``explorer.dynamic_sampling``: DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2). A group whose
rewards are all equal has advantage 0 under a group baseline (GRPO, Dr. GRPO, RLOO) and so carries no gradient: the
rollout worker does not write its experiences, and the explorer rolls out more tasks for the step until it holds
``batch_size`` groups whose rewards differ, or with ``metric: accuracy`` groups neither all correct nor all wrong
(``consumers/explorer/dynamic_sampling.py``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class DynamicSamplingConfig(Section):
    enabled: bool = Field(default=False, description="roll out more tasks until a step holds batch_size groups "
                                                     "whose rewards differ; the others are not trained")
    metric: Literal["reward", "accuracy"] = Field(
        default="reward", description="reward: a group counts when its rewards differ (shaped ones included); "
                                      "accuracy: when it is neither all correct nor all wrong (the DAPO paper's "
                                      "test; veRL filter_groups.metric acc)")
    max_rounds: int = Field(default=4, ge=1, le=64,
                            description="extra rounds of tasks a step may roll out to fill its batch; past them it "
                                        "trains the informative groups it has (a step with none goes on while "
                                        "tasks remain: the trainer needs a batch of every step)")
