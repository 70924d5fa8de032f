"""A task's workflow, built and run: the workflow its ``workflow`` names (a registered workflow, or an
environment's, run as an episode) with the reward its ``reward_fn`` names, ``repeat_times`` validated samples.
Here, not in :mod:`.base`, because an environment's workflow is an :mod:`.episode`, which builds on :mod:`.base`."""
from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

from streamrft.schemas import Task

from ..inference.base import InferenceEngine, SamplingParams
from ..settings.limits import WorkLimits
from .auxiliary import WorkflowContext
from .base import Workflow, WorkflowError, WorkflowSample, parse_payload
from .episode import episode_workflow
from .greedy import add_greedy_baseline
from .registry import (ENVIRONMENT_GROUP, WORKFLOW_GROUP, UnknownNameError, get_environment_class, get_reward,
                       is_environment, is_workflow, registered_workflow_class, workflow_names)
from .rewards import GroupReward


def get_workflow_class(name: str) -> Any:
    """The workflow class registered as ``name``; for an environment's name, an ``EpisodeWorkflow`` of it."""
    if is_workflow(name):
        return registered_workflow_class(name)
    if is_environment(name):
        return episode_workflow(get_environment_class(name))
    raise UnknownNameError(f"unknown workflow {name!r}; known: {workflow_names()} (plugins register under "
                           f"{WORKFLOW_GROUP!r}, environments under {ENVIRONMENT_GROUP!r})")


def build_workflow(task: Task, limits: WorkLimits | None = None, context: WorkflowContext | None = None,
                   payload: Mapping[str, Any] | None = None) -> Workflow:
    """The workflow named by ``task.workflow`` with the reward named by ``task.reward_fn`` (if any), given the
    run's ``context`` (auxiliary models). A group reward (a judge) is made for this task's ``payload`` here, so a
    model it needs and the run lacks fails the task before anything is generated."""
    cls = get_workflow_class(task.workflow)
    context = context or WorkflowContext()
    reward_fn = get_reward(task.reward_fn) if task.reward_fn else None
    if isinstance(reward_fn, type) and issubclass(reward_fn, GroupReward):
        reward_fn = reward_fn(context, payload if payload is not None else parse_payload(task))
    workflow = cls(reward_fn=reward_fn)
    workflow.limits = limits or WorkLimits()
    workflow.context = context
    return workflow


def run_workflow(
    task: Task,
    engine: InferenceEngine,
    repeat_times: int | None = None,
    sampling: SamplingParams | None = None,
    limits: WorkLimits | None = None,
    context: WorkflowContext | None = None,
    greedy_baseline: bool = False,
) -> list[WorkflowSample]:
    """Run ``task``'s workflow: ``repeat_times`` (else ``task.repeat_times``, else 1) validated samples, within
    ``limits``, with the run's auxiliary models (``context``); when the run has a teacher, each sample the
    reward scored gets the teacher's logprobs of its response tokens. ``greedy_baseline``: one more run at
    temperature 0 gives each sample ReMax's baseline (:mod:`.greedy`).

    Raises :class:`WorkflowError` for anything that goes wrong inside (its ``__cause__`` is the original).
    """
    repeat = repeat_times or task.repeat_times or 1
    sampling = sampling or SamplingParams()
    context = context or WorkflowContext()
    try:
        (limits or WorkLimits()).check_repeat_times(repeat)
        payload = parse_payload(task)
        workflow = build_workflow(task, limits, context, payload)
        samples = workflow.run(task, payload, engine, repeat, sampling)
        if len(samples) != repeat:
            raise ValueError(f"workflow returned {len(samples)} samples, {repeat} were asked for")
        if greedy_baseline:
            add_greedy_baseline(workflow, task, payload, engine, sampling, samples)
        if context.teacher is not None:
            scored = [s for s in samples if s.failure is None]
            for sample, logprobs in zip(scored, context.teacher.logprobs(scored, sampling.logprob_temperature)):
                sample.teacher_logprobs = logprobs
        for sample in samples:
            sample.validate()
        return samples
    except WorkflowError:
        raise
    except Exception as exc:
        raise WorkflowError(
            f"workflow {task.workflow!r} failed on task {task.task_id!r}: {type(exc).__name__}: {exc}",
            workflow=task.workflow,
            task_id=task.task_id,
            cause_traceback=traceback.format_exc(),
        ) from exc
