"""Workflows (task -> scored samples) and rewards, with registries open to plugins by entry point.

Built in: workflows ``arithmetic``, ``math_boxed``; multi-turn environments (:mod:`.episode`) ``guess_number`` and
``calculator`` (tool use, :mod:`.tools`); rewards ``exact_number``, ``boxed_match``, ``math_verify`` (:mod:`.math_verify`), ``format``, ``format_boxed``
and ``judge`` (an LLM judge, :mod:`.judge`, on one of the run's auxiliary models, :mod:`.auxiliary`; a teacher's
logprobs for on-policy distillation come from :mod:`.teacher`). The rollout worker runs tasks side by side on one engine in a :class:`WorkflowPool` (``scheduler``: continuous
batching) and turns a :class:`WorkflowError` into a FAILED result; :func:`run_workflows` runs a list of tasks to
the end that way.
"""
from . import judge, math_verify, rewards  # noqa: F401  (register the built-in rewards)
from .auxiliary import AuxiliaryModels, Teacher, UnknownAuxiliaryModel, WorkflowContext
from . import arithmetic, calculator, guess_number  # noqa: F401  (register the built-in workflows and environments)
from .base import (
    RewardFn,
    SingleTurnWorkflow,
    Workflow,
    WorkflowError,
    WorkflowSample,
    chat_suffix_ids,
    parse_payload,
)
from .build import build_workflow, get_workflow_class, run_workflow
from .episode import Environment, EpisodeWorkflow, Turn, episode_workflow
from .scheduler import SharedEngine, WorkflowPool, run_workflows
from .registry import (
    ENVIRONMENT_GROUP,
    REWARD_GROUP,
    WORKFLOW_GROUP,
    UnknownNameError,
    get_environment_class,
    get_reward,
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
from .judge import JudgeReward, judge_sampling, parse_score
from ..settings.judge import JudgeSettings
from .rewards import GroupReward, Reward, RewardFailure, answers_match, final_number, last_boxed, parse_number
from .teacher import check_same_tokenizer, reverse_kl, teacher_forced_logprobs

__all__ = [name for name in dir() if not name.startswith("_")]
