"""ReMax's baseline (Li et al. 2023, arXiv:2310.10505, §4 and Algorithm 1): one more run of a task's workflow at
temperature 0, beside its ``repeat_times`` samples. The greedy sample is scored like the others and never
trained on; its score is written on each sample as ``metrics["greedy_reward"]``
(:mod:`streamrft.schemas.experience_extras`), which ``advantage: remax`` subtracts from the sample's own.

It runs after the group, in the same workflow thread, so on the worker's shared engine it batches with whatever
else is running (continuous batching): the request takes one greedy sample longer, the engine does one sample
more per task."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from streamrft.schemas import Task
from streamrft.schemas.experience_extras import GREEDY_REWARD

from ..inference.base import InferenceEngine, SamplingParams
from .base import Workflow, WorkflowSample

logger = logging.getLogger(__name__)


def greedy_params(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` at temperature 0: the most likely token at each step (no top-p/top-k, no seed: nothing is
    drawn), the same token budget and stop strings."""
    return sampling.replace(temperature=0.0, top_p=1.0, top_k=0, seed=None)


def score_of(sample: WorkflowSample) -> float:
    """What the advantage estimators score a sample by: its reward plus its turns' rewards."""
    return float(sample.reward) + float(sum(sample.token_rewards or ()))


def add_greedy_baseline(workflow: Workflow, task: Task, payload: dict[str, Any], engine: InferenceEngine,
                        sampling: SamplingParams, samples: Sequence[WorkflowSample]) -> None:
    """Run ``workflow`` once greedily on ``task`` and write its score on every sample. A greedy sample the
    reward could not score (a judge's answer without a score) gives no baseline: the samples go without one
    and the trainer falls back to their group's mean (``remax``)."""
    (greedy,) = workflow.run(task, payload, engine, 1, greedy_params(sampling))
    if greedy.failure is not None:
        logger.warning("task %s: its greedy sample was not scored (%s); its group trains without a ReMax "
                       "baseline", task.task_id, greedy.failure)
        return
    baseline = score_of(greedy)
    for sample in samples:
        sample.metrics[GREEDY_REWARD] = baseline
