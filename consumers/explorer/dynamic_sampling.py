"""Dynamic sampling (``explorer.dynamic_sampling``; DAPO, Yu et al. 2025, arXiv:2503.14476, §3.2): a step is
filled with more tasks until ``batch_size`` of its groups are informative (their rewards differ, or with
``metric: accuracy`` they are neither all correct nor all wrong: :func:`streamrft.rollout_stats.informative`).

The rollout worker does not write the experiences of a group that is not (the same test on the same
``RolloutResult``), so what the trainer reads of a step is exactly its informative groups. Once every result
of a step is in, and fewer than ``batch_size`` are informative, the explorer publishes ``batch_size − informative``
more tasks for the same step (an extra round), in the transaction that writes its state record: the step then
holds at most ``batch_size`` informative groups, never a surplus the trainer would carry into later steps. After
``max_rounds`` extra rounds the step finishes with what it has (the trainer trains a short batch), except a step
with no informative group at all, which goes on while tasks remain: the trainer trains one batch per step, and a
step it gets nothing of would leave its weights a version behind the explorer's pacing for good. A step waiting for
tasks (a streaming topic) waits like the next step would; ``step_timeout_s`` bounds it all.

A restarted explorer knows a step's rounds so far from its state record (``oversampled``) and its results from
``results``, and goes on from there.
"""
from __future__ import annotations

import logging

from streamrft.config import ExplorerConfig
from streamrft.rollout_stats import informative
from streamrft.schemas import RolloutRequest, RolloutStatus

from .rounds import Round, train_requests
from .schedule import TaskSchedule

logger = logging.getLogger(__name__)


class DynamicSampling:
    def __init__(self, settings: ExplorerConfig) -> None:
        self.enabled = settings.dynamic_sampling.enabled
        self.max_rounds = settings.dynamic_sampling.max_rounds
        self.metric = settings.dynamic_sampling.metric
        self.batch_size = settings.batch_size
        self.repeat_times = settings.repeat_times

    def wanted(self, round_: Round) -> int:
        """How many more tasks step ``round_`` wants now (0 while results are missing, or once it is full or out
        of rounds)."""
        if not self.enabled or round_.eval_taskset is not None or round_.missing:
            return 0
        found = sum(informative(result, self.metric) for result in round_.results.values())
        if found >= self.batch_size or (found and round_.oversampled >= self.max_rounds):
            return 0
        return self.batch_size - found

    def top_up(self, round_: Round, tasks: TaskSchedule, min_model_version: int,
               deadline_ms: int | None) -> list[RolloutRequest]:
        """The requests of step ``round_``'s next extra round, already added to it (the caller publishes them);
        none when it wants no more, or no task is there now (then it waits for one unless the tasks are out)."""
        wanted = self.wanted(round_)
        round_.wants_tasks = False
        if not wanted:
            return []
        batch = tasks.take(round_.step, wanted, draw=round_.oversampled + 1) if tasks.ready(wait=False) else []
        round_.wants_tasks = not batch and not tasks.exhausted
        if not batch:
            return []
        found = self.batch_size - wanted
        requests = train_requests(round_.step, batch, self.repeat_times, min_model_version, deadline_ms,
                                  taken=round_.requests)
        round_.requests.update(requests)
        round_.oversampled += 1
        logger.info("explorer: step %d has %d of %d informative groups; round %d rolls out %d more task(s)",
                    round_.step, found, self.batch_size, round_.oversampled, len(requests))
        return list(requests.values())

    def metrics(self, round_: Round) -> dict[str, float]:
        """``rollout/informative_groups`` (their experiences are trained), ``rollout/filtered_groups`` (OK groups
        whose rewards are all equal: not written) and ``rollout/oversample_rounds`` of a finished step."""
        if not self.enabled:
            return {}
        ok = [result for result in round_.results.values() if result.status == RolloutStatus.OK]
        found = sum(informative(result, self.metric) for result in ok)
        return {"rollout/informative_groups": float(found), "rollout/filtered_groups": float(len(ok) - found),
                "rollout/oversample_rounds": float(round_.oversampled)}
