"""Name -> workflow class, name -> environment class and name -> reward function.

Built-ins register themselves with the decorators below when their modules are imported (the package
``__init__`` imports them). Plugins are found by name in the entry-point groups ``streamrft.workflows``,
``streamrft.environments`` and ``streamrft.rewards``, for example in a plugin's ``pyproject.toml``::

    [project.entry-points."streamrft.workflows"]
    my_workflow = "my_package.workflows:MyWorkflow"
    [project.entry-points."streamrft.environments"]
    my_env = "my_package.envs:MyEnvironment"
    [project.entry-points."streamrft.rewards"]
    my_score = "my_package.rewards:score"

An environment (``streamrft.engines.workflows.episode.Environment``) is run by a multi-turn
``EpisodeWorkflow``; a task names it like any workflow (``workflow: my_env``), so one name space serves both.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

WORKFLOW_GROUP = "streamrft.workflows"
ENVIRONMENT_GROUP = "streamrft.environments"
REWARD_GROUP = "streamrft.rewards"

_WORKFLOWS: dict[str, Any] = {}
_ENVIRONMENTS: dict[str, Any] = {}
_REWARDS: dict[str, Callable[..., Any]] = {}

T = TypeVar("T")


class UnknownNameError(KeyError):
    """No workflow or reward of that name is registered or installed as a plugin."""

    def __str__(self) -> str:  # KeyError quotes its argument; this message is a sentence
        return str(self.args[0])


def register_workflow(name: str, *, replace: bool = False) -> Callable[[T], T]:
    """Class decorator: make a Workflow subclass available under ``name``."""
    return _register(_WORKFLOWS, "workflow", name, replace)


def register_environment(name: str, *, replace: bool = False) -> Callable[[T], T]:
    """Class decorator: make an Environment subclass available under ``name`` (tasks run it as workflow
    ``name``, through an ``EpisodeWorkflow``)."""
    return _register(_ENVIRONMENTS, "environment", name, replace)


def register_reward(name: str, *, replace: bool = False) -> Callable[[T], T]:
    """Function decorator: make a reward function available under ``name``."""
    return _register(_REWARDS, "reward", name, replace)


def _register(table: dict[str, Any], what: str, name: str, replace: bool) -> Callable[[T], T]:
    def decorate(obj: T) -> T:
        if name in table and table[name] is not obj and not replace:
            raise ValueError(f"{what} {name!r} is already registered (pass replace=True to override)")
        table[name] = obj
        return obj

    return decorate


def unregister_workflow(name: str) -> None:
    _WORKFLOWS.pop(name, None)


def unregister_environment(name: str) -> None:
    _ENVIRONMENTS.pop(name, None)


def unregister_reward(name: str) -> None:
    _REWARDS.pop(name, None)


def is_workflow(name: str) -> bool:
    """A workflow (built in or a plugin) is registered as ``name``."""
    return name in _WORKFLOWS or _plugin(WORKFLOW_GROUP, name) is not None


def is_environment(name: str) -> bool:
    """An environment (built in or a plugin) is registered as ``name``."""
    return name in _ENVIRONMENTS or _plugin(ENVIRONMENT_GROUP, name) is not None


def registered_workflow_class(name: str) -> Any:
    """The workflow class registered as ``name`` (an environment's workflow is built by
    :func:`streamrft.engines.workflows.build.get_workflow_class`)."""
    return _lookup(_WORKFLOWS, WORKFLOW_GROUP, "workflow", name)


def get_environment_class(name: str) -> Any:
    return _lookup(_ENVIRONMENTS, ENVIRONMENT_GROUP, "environment", name)


def get_reward(name: str) -> Callable[..., Any]:
    return _lookup(_REWARDS, REWARD_GROUP, "reward", name)


def workflow_names() -> list[str]:
    """Every name a task may give as its workflow: workflows and environments, built in or plugins."""
    return sorted(set(_WORKFLOWS) | set(_ENVIRONMENTS) | {ep.name for ep in entry_points(group=WORKFLOW_GROUP)}
                  | {ep.name for ep in entry_points(group=ENVIRONMENT_GROUP)})


def reward_names() -> list[str]:
    return sorted(set(_REWARDS) | {ep.name for ep in entry_points(group=REWARD_GROUP)})


def _plugin(group: str, name: str):
    return next(iter(entry_points(group=group, name=name)), None)


def _lookup(table: dict[str, Any], group: str, what: str, name: str) -> Any:
    if name in table:
        return table[name]
    ep = _plugin(group, name)
    if ep is not None:
        obj = ep.load()  # an import error in a plugin propagates: the caller reports it
        logger.info("loaded %s plugin %r from %s", what, name, ep.value)
        table[name] = obj
        return obj
    known = sorted(set(table) | {ep.name for ep in entry_points(group=group)})
    raise UnknownNameError(f"unknown {what} {name!r}; known: {known} (plugins register under {group!r})")
