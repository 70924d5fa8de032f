"""Multi-turn episodes: the model acts, an environment (a game, a tool, a simulated user) answers, for several turns.

An :class:`Environment` is the world of one episode. ``opening()`` gives the first messages, ``step(text)``
answers one model turn with a :class:`Turn` (the messages the environment adds, a reward for that turn, whether
the episode is over) and ``outcome()`` scores the episode once it has ended. Register one with
``@register_environment("name")`` or the ``streamrft.environments`` entry-point group; a task then names it as
its workflow and :class:`EpisodeWorkflow` runs it.

One episode is one sample:

- ``tokens`` are the opening prompt, then model turns and environment turns interleaved: the model's turns are
  the ids it sampled, the environment's are the chat template's rendering of its messages
  (:func:`~.base.chat_suffix_ids`), so the sequence is what the model saw at every turn;
- ``action_mask`` is 1 on the tokens the model sampled and 0 on what the environment inserted (their logprob is
  0.0): the trainer's loss touches model tokens only;
- a turn's reward is put in ``token_rewards`` on the last token of that model turn (per-step rewards); the
  episode's ``reward`` is ``outcome()`` (or the task's ``reward_fn`` on the last model turn, when it names
  one). ``grpo`` scores an episode as reward + Σ turn rewards and gives that advantage to every model token;
  ``grpo_reward_to_go`` gives each turn the rewards from that turn on;
- each model turn records the state it was taken in (``info["turn_states"]``,
  :mod:`streamrft.schemas.experience_extras`): :meth:`Environment.state` when the environment defines it, else
  the conversation so far, so turns of different episodes in the same state can be compared (GiGPO's anchor
  states, ``advantage: gigpo``);
- the run's budget, ``limits.max_turns`` model turns and ``limits.max_episode_tokens`` response tokens (model
  and environment), cuts an episode the environment has not ended, and so do the engine's positions
  (``max_model_len``: a longer sequence could not be trained): it is then ``truncated`` (and
  ``trainer.algorithm.mask_truncated`` can keep it out of the loss). A model turn is never longer than the
  tokens left, and an episode always ends on a model turn (an environment reply with no room for an answer
  after it is not added).

The ``repeat_times`` episodes of a task advance together: one batched engine call per turn. Episode ``k``
samples turn ``t`` with seed ``seed + t * repeat_times + k`` when a seed is set.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from streamrft.schemas.experience_extras import TURN_STATES, encode_turn_states, state_key

from ..inference.base import Completion, Message
from .base import Workflow, WorkflowSample, add_versions, chat_suffix_ids
from .rewards import Reward, RewardFailure

Finish = Literal["done", "max_turns", "max_tokens", "max_model_len"]


@dataclass(frozen=True, slots=True)
class Turn:
    """The environment's answer to one model turn: what it says next (ignored once ``done``), the reward of
    that model turn, and whether the episode is over."""

    messages: Sequence[Message] = ()
    reward: float = 0.0
    done: bool = False


class Environment(ABC):
    """The world of one episode; a fresh instance per episode, built from the task's payload (raise KeyError
    or ValueError there for a payload it cannot use: the task FAILS with that message)."""

    # Model turns the environment's own rules allow (e.g. a game of six guesses), if it has such a rule: a task
    # asking for more than ``limits.max_turns`` then fails at once instead of being cut.
    max_turns: int | None = None

    def __init__(self, payload: Mapping[str, Any]) -> None:
        self.payload = payload

    @abstractmethod
    def opening(self) -> list[Message]:
        """The chat messages the episode starts with."""

    @abstractmethod
    def step(self, text: str) -> Turn:
        """Answer the model's turn ``text`` (its decoded response)."""

    @abstractmethod
    def outcome(self) -> Reward:
        """The episode's reward, once it has ended (by ``done`` or by the budget)."""

    def metrics(self) -> dict[str, float]:
        """Numbers about the episode for the sample's metrics (e.g. ``tool_calls``)."""
        return {}

    def info(self) -> dict[str, str]:
        """Strings about the episode for the sample's info."""
        return {}

    def state(self) -> str | None:
        """The state the next model turn is taken in, as text equal for equal states (what the model is shown
        of the world, not how it got there); None: the whole conversation so far is the state."""
        return None


@dataclass
class _Episode:
    env: Environment
    opening: list[Message]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    turns_cut: int = 0  # model turns that hit sampling.max_tokens
    finish: Finish | None = None
    last_text: str = ""
    transcript: list[str] = field(default_factory=list)
    model_version: int | None = None  # of its first model token
    version_switches: list[tuple[int, int]] = field(default_factory=list)
    turn_states: list[tuple[int, str]] = field(default_factory=list)  # (first response index, state key)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, completion: Completion) -> None:
        if completion.response_ids:  # a turn is a span of tokens: an empty one has no action to credit
            state = self.env.state()
            self.turn_states.append((len(self.response_ids), state_key(
                state if state is not None else array("i", self.context).tobytes())))
        self.model_version = add_versions(self.model_version, self.version_switches, completion,
                                          len(self.response_ids))
        self.response_ids += completion.response_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.response_ids)
        self.token_rewards += [0.0] * len(completion.response_ids)
        self.turns += 1
        self.turns_cut += completion.truncated
        self.last_text = completion.text
        self.transcript.append(f"assistant: {completion.text}")

    def reward_turn(self, reward: float) -> None:
        """The reward of the model turn just added, on its last token."""
        if self.token_rewards:
            self.token_rewards[-1] += float(reward)

    def add_env_turn(self, ids: list[int], messages: Sequence[Message]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.token_rewards += [0.0] * len(ids)
        self.transcript += [f"{m['role']}: {m['content']}" for m in messages]


class EpisodeWorkflow(Workflow):
    """Runs ``environment_class`` episodes (see the module docstring). :func:`episode_workflow` makes one per
    registered environment; subclass it directly only to change how episodes run."""

    environment_class: ClassVar[type[Environment]]
    default_reward = None  # the environment's outcome, unless the task names a reward

    def run(self, task, payload, engine, repeat_times, sampling):
        environments = [self.environment_class(payload) for _ in range(repeat_times)]
        max_turns = self._turn_budget(environments[0])
        episodes = []
        for env in environments:
            opening = list(env.opening())
            episodes.append(_Episode(env=env, opening=opening, prompt_ids=list(engine.prompt_ids(opening))))

        for turn in range(max_turns):
            for episode in episodes:  # a model turn needs room, in the budget and in the model's positions
                if episode.finish is None and self._room(episode, engine) < 1:
                    episode.finish = self._limit(episode, engine)
            active = [k for k, episode in enumerate(episodes) if episode.finish is None]
            if not active:
                break
            params = [
                sampling.replace(seed=None if sampling.seed is None else sampling.seed + turn * repeat_times + k,
                                 max_tokens=min(sampling.max_tokens, self._room(episodes[k], engine)))
                for k in active
            ]
            outputs = engine.generate([episodes[k].context for k in active], params, n=1)
            for k, (completion,) in zip(active, outputs):
                self._advance(episodes[k], completion, engine, last_turn=turn == max_turns - 1)
        return [self._sample(episode, payload) for episode in episodes]

    def _turn_budget(self, env: Environment) -> int:
        if env.max_turns is None:
            return self.limits.max_turns
        self.limits.check_turns(env.max_turns)
        return env.max_turns

    def _tokens_left(self, episode: _Episode) -> int:
        return self.limits.max_episode_tokens - len(episode.response_ids)

    def _room(self, episode: _Episode, engine) -> int:
        """Tokens the episode may still add: its budget, and the engine's positions when it has a limit."""
        if engine.max_model_len is None:
            return self._tokens_left(episode)
        return min(self._tokens_left(episode), engine.max_model_len - len(episode.context))

    def _limit(self, episode: _Episode, engine) -> Finish:
        """Which limit leaves no room: the episode's token budget or the model's positions."""
        return "max_tokens" if self._tokens_left(episode) <= self._room(episode, engine) else "max_model_len"

    def _advance(self, episode: _Episode, completion: Completion, engine, *, last_turn: bool) -> None:
        """Add the model's turn, let the environment answer, and end the episode or add the answer."""
        episode.add_model_turn(completion)
        reply = episode.env.step(completion.text)
        episode.reward_turn(reply.reward)
        if reply.done:
            episode.finish = "done"
        elif last_turn:
            episode.finish = "max_turns"
        else:
            suffix = chat_suffix_ids(engine, episode.opening, list(reply.messages),
                                     after_eos=completion.ended_with_eos)
            if len(suffix) >= self._room(episode, engine):  # no room left for a model turn after it
                episode.finish = self._limit(episode, engine)
            else:
                episode.add_env_turn(suffix, reply.messages)

    def _sample(self, episode: _Episode, payload: Mapping[str, Any]) -> WorkflowSample:
        failure = None
        if self.reward_fn is None:
            reward = episode.env.outcome()
        else:
            try:
                reward = self.score(episode.last_text, payload, prompt=episode.opening[-1]["content"])
            except RewardFailure as exc:  # e.g. a judge's answer without a score: this episode fails alone
                reward, failure = Reward(0.0), exc
        return WorkflowSample(
            tokens=episode.context,
            prompt_length=len(episode.prompt_ids),
            logprobs=episode.logprobs,
            action_mask=episode.mask,
            token_rewards=episode.token_rewards if any(episode.token_rewards) else None,
            reward=reward.value,
            truncated=episode.finish != "done",
            prompt_text=episode.opening[-1]["content"],
            response_text="\n".join(episode.transcript),
            metrics={
                "turns": float(episode.turns),
                "turns_cut": float(episode.turns_cut),
                "response_length": float(len(episode.response_ids)),
                "model_tokens": float(sum(episode.mask)),
                **episode.env.metrics(),
                **reward.metrics,
            },
            info={"finish": episode.finish or "", TURN_STATES: encode_turn_states(episode.turn_states),
                  **episode.env.info(), **reward.info},
            correct=reward.correct,
            model_version=episode.model_version,
            version_switches=episode.version_switches,
            failure=failure,
        )


def episode_workflow(environment_class: type[Environment]) -> type[EpisodeWorkflow]:
    """The workflow class that runs ``environment_class`` (one per class, so lookups return the same one)."""
    workflow = _WORKFLOW_OF.get(environment_class)
    if workflow is None:
        workflow = type(f"{environment_class.__name__}Workflow", (EpisodeWorkflow,),
                        {"environment_class": environment_class, "__module__": __name__})
        _WORKFLOW_OF[environment_class] = workflow
    return workflow


_WORKFLOW_OF: dict[type[Environment], type[EpisodeWorkflow]] = {}
