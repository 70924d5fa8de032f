"""Workflows (task -> scored samples) and rewards, with registries open to plugins by entry point.

Built in: workflows ``arithmetic``, ``math_boxed``; multi-turn environments (:mod:`.episode`) ``guess_number`` and
``calculator`` (tool use, :mod:`.tools`); rewards ``exact_number``, ``boxed_match``, ``format``, ``format_boxed``. The rollout worker runs tasks side by side on one engine in a :class:`WorkflowPool` (``scheduler``: continuous
batching) and turns a :class:`WorkflowError` into a FAILED result; :func:`run_workflows` runs a list of tasks to
the end that way.
"""
from . import rewards  # noqa: F401  (registers the built-in rewards)
from . import arithmetic, calculator, guess_number  # noqa: F401  (register the built-in workflows and environments)
from .base import (
    RewardFn,
    SingleTurnWorkflow,
    Workflow,
    WorkflowError,
    WorkflowSample,
    build_workflow,
    chat_suffix_ids,
    parse_payload,
    run_workflow,
)
from .episode import Environment, EpisodeWorkflow, Turn, episode_workflow
from .scheduler import SharedEngine, WorkflowPool, run_workflows
from .registry import (
    ENVIRONMENT_GROUP,
    REWARD_GROUP,
    WORKFLOW_GROUP,
    UnknownNameError,
    get_environment_class,
    get_reward,
    get_workflow_class,
    register_environment,
    register_reward,
    register_workflow,
    reward_names,
    unregister_environment,
    unregister_reward,
    unregister_workflow,
    workflow_names,
)
from .tools import Tool, ToolEnvironment, ToolError
from .rewards import Reward, answers_match, final_number, last_boxed, parse_number

__all__ = [name for name in dir() if not name.startswith("_")]
