"""Per-step rollout metrics from RolloutResults (pure: no Kafka, no model)."""
from __future__ import annotations

import math
from collections import Counter

from streamrft.schemas import RolloutResult, RolloutStatus


def informative(result: RolloutResult, by: str = "reward") -> bool:
    """A group whose rewards differ (``by="reward"``). Under a group baseline (GRPO, Dr. GRPO, RLOO) the
    advantages of a group whose rewards are all equal are all 0: it carries no gradient (DAPO's dynamic sampling
    leaves such groups out). ``by="accuracy"``: a group neither all correct nor all wrong, the DAPO paper's test."""
    if result.status != RolloutStatus.OK or result.n < 2:
        return False
    if by == "accuracy":
        return 0.0 < result.accuracy < 1.0
    return result.reward_max > result.reward_min


def retry_metrics(attempts: list[RolloutResult]) -> dict[str, float]:
    """Attempts that failed and were published again (``explorer.max_retries``), by status; the step's other
    ``rollout/*`` counts are of the attempts that stand."""
    statuses = Counter(r.status for r in attempts)
    return {"rollout/retries": float(len(attempts)),
            "rollout/retried_failed": float(statuses[RolloutStatus.FAILED]),
            "rollout/retried_timeout": float(statuses[RolloutStatus.TIMEOUT])}


def step_metrics(results: list[RolloutResult], step: int, version: int, expected: int) -> dict[str, float]:
    """``rollout/*`` metrics of one step. Reward statistics pool the samples of every OK task (reward_std is
    the pooled standard deviation over all samples, from each task's mean, std and n)."""
    ok = [r for r in results if r.status == RolloutStatus.OK and r.n > 0]
    statuses = Counter(r.status for r in results)
    out: dict[str, float] = {
        "rollout/tasks": float(expected),
        "rollout/ok": float(statuses[RolloutStatus.OK]),
        "rollout/failed": float(statuses[RolloutStatus.FAILED]),
        "rollout/cancelled": float(statuses[RolloutStatus.CANCELLED] + max(expected - len(results), 0)),
        "rollout/timeout": float(statuses[RolloutStatus.TIMEOUT]),
        "rollout/model_version": float(version),
        "rollout/staleness": float(step - version),
    }
    samples = sum(r.n for r in ok)
    if not samples:
        return out
    mean = sum(r.reward_mean * r.n for r in ok) / samples
    variance = sum(r.n * (r.reward_std ** 2 + (r.reward_mean - mean) ** 2) for r in ok) / samples
    out.update({
        "rollout/samples": float(samples),
        "rollout/reward_mean": mean,
        "rollout/reward_std": math.sqrt(max(variance, 0.0)),
        "rollout/reward_min": min(r.reward_min for r in ok),
        "rollout/reward_max": max(r.reward_max for r in ok),
        "rollout/accuracy": sum(r.accuracy * r.n for r in ok) / samples,
        "rollout/pass_rate": sum(1.0 for r in ok if r.reward_max > 0) / len(ok),
        "rollout/response_length": sum(r.response_length_mean * r.n for r in ok) / samples,
        "rollout/staleness_mean": sum((step - r.model_version) * r.n for r in ok) / samples,
        "time/rollout_task_ms": sum(r.duration_ms for r in ok) / len(ok),
    })
    return out


def taskset_metrics(results: list[RolloutResult], tasksets: list[str]) -> dict[str, float]:
    """Per training taskset (``explorer.tasksets``), of one step: ``rollout/taskset/<name>/tasks`` (its share of
    the step), ``samples``, ``reward_mean`` and ``accuracy`` over its OK samples."""
    out: dict[str, float] = {}
    for name in tasksets:
        mine = [r for r in results if r.taskset == name]
        ok = [r for r in mine if r.status == RolloutStatus.OK and r.n > 0]
        samples = sum(r.n for r in ok)
        out[f"rollout/taskset/{name}/tasks"] = float(len(mine))
        out[f"rollout/taskset/{name}/samples"] = float(samples)
        if samples:
            out[f"rollout/taskset/{name}/reward_mean"] = sum(r.reward_mean * r.n for r in ok) / samples
            out[f"rollout/taskset/{name}/accuracy"] = sum(r.accuracy * r.n for r in ok) / samples
    return out


def eval_metrics(name: str, results: list[RolloutResult], n: int) -> dict[str, float]:
    """``eval/<name>/mean@n`` (mean reward over all samples) and ``best@n`` (mean over tasks of the best
    sample's reward), plus accuracy@n."""
    ok = [r for r in results if r.status == RolloutStatus.OK and r.n > 0]
    if not ok:
        return {f"eval/{name}/failed": float(len(results))}
    samples = sum(r.n for r in ok)
    return {
        f"eval/{name}/mean@{n}": sum(r.reward_mean * r.n for r in ok) / samples,
        f"eval/{name}/best@{n}": sum(r.reward_max for r in ok) / len(ok),
        f"eval/{name}/accuracy@{n}": sum(r.accuracy * r.n for r in ok) / samples,
        f"eval/{name}/tasks": float(len(ok)),
    }
