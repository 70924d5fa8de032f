"""What a request the core is done with becomes: the Experience records of its scored samples and its
RolloutResult. No Kafka in here: the rollout worker stages both on its transaction, with the dead letter of a
request that FAILED (which names the record as read, so it is the worker's to write)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from streamrft.schemas import Experience, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus

from ..workflows.base import WorkflowSample
from .core import Done
from .reward_shaping import OverlongShaping

FAILURES_SHOWN = 5  # samples a result's error names: the text stays well inside what a result keeps
ERROR_CHARS = 8000  # the tail of an error a result keeps


@dataclass
class Assembled:
    """A finished request's records. ``failure``: (reason, error) when it FAILED, for its dead letter;
    ``unscored``: the reward of each sample it could not score; ``tokens``: the response tokens it generated;
    ``penalties``: the overlong penalty of each scored sample (``rollout.overlong_penalty``; none without it)."""

    experiences: list[Experience]
    result: RolloutResult
    failure: tuple[str, str] | None = None
    unscored: list[str] = field(default_factory=list)
    tokens: int = 0
    penalties: list[float] = field(default_factory=list)


def assemble(done: Done, worker_id: str, shaping: OverlongShaping | None = None) -> Assembled:
    """The records of ``done``, written by ``worker_id``; a training request's rewards shaped by ``shaping``."""
    if done.status == RolloutStatus.OK:
        assembled = _succeeded(done, worker_id, shaping)
    elif done.status == RolloutStatus.FAILED:
        assembled = _failed(done, done.error or "", done.reason or "failed", worker_id)
    else:
        assembled = Assembled([], result(done.request, done.status, [], done.version, worker_id, error=done.error))
    assembled.result.duration_ms = int(done.duration_s * 1000)
    return assembled


def _succeeded(done: Done, worker_id: str, shaping: OverlongShaping | None) -> Assembled:
    """Experiences of the samples the reward scored. A sample it could not score (a judge's answer without a
    score) is left out of the group and named in the result's ``error``; with none scored the request FAILS
    (``reward-failed``)."""
    request, samples = done.request, done.samples
    tokens = sum(s.response_length for s in samples)
    scored = [(index, s) for index, s in enumerate(samples) if s.failure is None]
    failures = [(index, s.failure) for index, s in enumerate(samples) if s.failure is not None]
    unscored = [failure.source for _, failure in failures]
    why = failures_text(failures, len(samples)) if failures else None
    if not scored:
        failed = _failed(done, why, "reward-failed", worker_id)
        failed.unscored, failed.tokens = unscored, tokens
        return failed
    experiences, penalties = [], []
    if shaping is not None and request.kind == RolloutKind.TRAIN:
        penalties = shaping.apply([sample for _, sample in scored])
    if request.kind == RolloutKind.TRAIN:  # eval rollouts produce results and metrics only
        experiences = [
            sample.to_experience(eid=f"{request.request_id}/{index}", group_id=request.request_id,
                                 task_id=request.task.task_id, step=request.step, kind=request.kind,
                                 run_index=index, worker_id=worker_id, default_version=done.version)
            for index, sample in scored
        ]
        for experience in experiences:
            experience.group_size = len(scored)
    kept = [sample for _, sample in scored]
    return Assembled(experiences, result(request, RolloutStatus.OK, kept, done.version, worker_id, error=why),
                     unscored=unscored, tokens=tokens, penalties=penalties)


def _failed(done: Done, error: str, reason: str, worker_id: str) -> Assembled:
    """A FAILED result with the reason (the worker dead-letters the request beside it)."""
    return Assembled([], result(done.request, RolloutStatus.FAILED, [], done.version, worker_id, error=error),
                     failure=(reason, error))


def result(request: RolloutRequest, status: RolloutStatus, samples: list[WorkflowSample], version: int,
           worker_id: str, error: str | None = None) -> RolloutResult:
    """A request's light outcome, for the explorer: its status and its samples' reward statistics."""
    rewards = [s.reward for s in samples] or [0.0]
    return RolloutResult(
        request_id=request.request_id, step=request.step, task_id=request.task.task_id,
        kind=request.kind, status=status, n=len(samples), model_version=version, duration_ms=0,
        reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
        reward_min=min(rewards), reward_max=max(rewards),
        accuracy=statistics.fmean([float(s.correct) for s in samples]) if samples else 0.0,
        response_length_mean=statistics.fmean([s.response_length for s in samples]) if samples else 0.0,
        error=error[-ERROR_CHARS:] if error else None, worker_id=worker_id, taskset=request.task.taskset)


def failures_text(failures: list, total: int, shown: int = FAILURES_SHOWN) -> str:
    """What a result's ``error`` says of the samples their reward could not score (the first ``shown`` of
    them)."""
    listed = "; ".join(f"sample {index}: {failure}" for index, failure in failures[:shown])
    more = f"; and {len(failures) - shown} more" if len(failures) > shown else ""
    return f"{len(failures)} of {total} sample(s) not scored, so not trained on: {listed}{more}"
