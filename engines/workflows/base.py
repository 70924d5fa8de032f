"""Workflows: a Task + an inference engine -> ``repeat_times`` scored samples.

A workflow never touches Kafka: the rollout worker calls :func:`run_workflow`, turns each
:class:`WorkflowSample` into an ``Experience`` (:meth:`WorkflowSample.to_experience`) and reports a
``RolloutResult``. Whatever goes wrong inside a workflow or a reward -- a bad payload, an unknown name, a
plugin that raises -- comes out of :func:`run_workflow` as one exception type, :class:`WorkflowError`, which the
worker turns into a FAILED result; the process carries on.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from streamrft.schemas import Experience, RolloutKind, Task, pack_f32, pack_i32, pack_u8

from ..inference.base import Completion, InferenceEngine, Message, SamplingParams
from .auxiliary import WorkflowContext
from ..settings.limits import WorkLimits
from .registry import get_reward
from .rewards import GroupReward, Reward, RewardFailure

RewardFn = Callable[[str, Mapping[str, Any]], Any]


class WorkflowError(Exception):
    """A workflow could not produce its samples. ``cause_traceback`` holds the original traceback as text
    (for the FAILED result's ``error`` field)."""

    def __init__(self, message: str, *, workflow: str = "", task_id: str = "", cause_traceback: str = "") -> None:
        super().__init__(message)
        self.workflow = workflow
        self.task_id = task_id
        self.cause_traceback = cause_traceback


@dataclass(slots=True)
class WorkflowSample:
    """One scored sample. ``tokens`` are prompt + response ids; ``logprobs`` (and ``action_mask`` and
    ``token_rewards`` when set) cover the response only: ``len(logprobs) == len(tokens) - prompt_length``.
    ``action_mask`` is 1 for tokens the policy produced (trained on) and 0 for tokens an environment inserted;
    None means all ones. ``token_rewards`` are per-step rewards (e.g. a multi-turn episode's turn rewards on the
    last token of each turn), added to ``reward`` by the advantage estimators. ``truncated``: the sample was cut
    by a budget (``max_tokens``, an episode's turns or tokens) rather than ending on its own.
    ``teacher_logprobs``: a teacher's logprob of each response token (on-policy distillation), when the run has
    one. ``failure``: why the reward could not score this sample (a judge's answer without a score); such a
    sample is reported, never trained on."""

    tokens: list[int]
    prompt_length: int
    logprobs: list[float]
    reward: float
    action_mask: list[int] | None = None
    token_rewards: list[float] | None = None
    truncated: bool = False
    prompt_text: str = ""
    response_text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    correct: bool = False
    # the weights its first model token came from (staleness counts from it); None: a workflow that does not
    # say, taken as the engine's version when the request finished
    model_version: int | None = None
    # newer weights that took over while it was generated (rollout.weight_update: in_flight): (index of the
    # first response token of a version, that version), oldest first
    version_switches: list[tuple[int, int]] = field(default_factory=list)
    teacher_logprobs: list[float] | None = None
    failure: RewardFailure | None = None

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def last_model_version(self) -> int | None:
        return self.version_switches[-1][1] if self.version_switches else self.model_version

    def validate(self) -> None:
        """Raise ValueError when the lengths do not line up (a buggy plugin workflow)."""
        n = self.response_length
        if self.prompt_length < 1 or n < 1:
            raise ValueError(f"sample needs a prompt and a response, got {self.prompt_length} + {n} tokens")
        if len(self.logprobs) != n:
            raise ValueError(f"{len(self.logprobs)} logprobs for {n} response tokens")
        if self.action_mask is not None and len(self.action_mask) != n:
            raise ValueError(f"action mask of {len(self.action_mask)} for {n} response tokens")
        if self.token_rewards is not None and len(self.token_rewards) != n:
            raise ValueError(f"{len(self.token_rewards)} token rewards for {n} response tokens")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"{len(self.teacher_logprobs)} teacher logprobs for {n} response tokens")

    def to_experience(
        self,
        *,
        eid: str,
        group_id: str,
        task_id: str,
        step: int,
        kind: RolloutKind,
        run_index: int,
        worker_id: str = "",
        default_version: int = 0,
    ) -> Experience:
        """The sample as an Experience; ``default_version`` is its version when the workflow did not say."""
        if self.failure is not None:
            raise ValueError(f"a sample its reward could not score is not an experience ({self.failure})")
        first = self.model_version if self.model_version is not None else default_version
        info = {k: str(v) for k, v in self.info.items()}
        if self.version_switches:
            info["version_switches"] = ",".join(f"{index}:{version}" for index, version in self.version_switches)
        return Experience(
            eid=eid,
            group_id=group_id,
            task_id=task_id,
            step=step,
            kind=kind,
            run_index=run_index,
            model_version=first,
            last_model_version=self.last_model_version if self.version_switches else first,
            tokens=pack_i32(self.tokens),
            prompt_length=self.prompt_length,
            logprobs=pack_f32(self.logprobs),
            reward=float(self.reward),
            action_mask=None if self.action_mask is None else pack_u8(self.action_mask),
            token_rewards=None if self.token_rewards is None else pack_f32(self.token_rewards),
            teacher_logprobs=None if self.teacher_logprobs is None else pack_f32(self.teacher_logprobs),
            truncated=self.truncated,
            prompt_text=self.prompt_text,
            response_text=self.response_text,
            metrics={k: float(v) for k, v in self.metrics.items()},
            info=info,
            worker_id=worker_id,
        )


class Workflow(ABC):
    """Turns one task into samples. Subclasses set ``default_reward`` (a reward name) and implement
    :meth:`run`; ``self.reward_fn`` is the task's ``reward_fn`` when it names one, else the default.
    ``self.context`` holds the run's auxiliary models by name (``self.context.auxiliary["judge"]`` is an engine
    like the policy's), see :mod:`.auxiliary`."""

    default_reward: ClassVar[str | None] = None
    limits: WorkLimits = WorkLimits()  # set per task by build_workflow; multi-turn workflows check turns
    context: WorkflowContext = WorkflowContext()  # set per task by build_workflow

    def __init__(self, reward_fn: RewardFn | GroupReward | None = None) -> None:
        if reward_fn is None and self.default_reward is not None:
            reward_fn = get_reward(self.default_reward)
        self.reward_fn = reward_fn

    def score(self, response: str, payload: Mapping[str, Any], prompt: str = "") -> Reward:
        """One response's reward (``prompt``: what the model was asked, for a reward that reads it, as a judge
        does). Raises :class:`RewardFailure` when the reward cannot score it."""
        if self.reward_fn is None:
            raise ValueError(f"{type(self).__name__} has no reward function")
        if isinstance(self.reward_fn, GroupReward):
            (result,) = self.reward_fn.score_group(prompt, [response], payload)
            if isinstance(result, RewardFailure):
                raise result
            return result
        return Reward.of(self.reward_fn(response, payload))

    @abstractmethod
    def run(
        self,
        task: Task,
        payload: dict[str, Any],
        engine: InferenceEngine,
        repeat_times: int,
        sampling: SamplingParams,
    ) -> list[WorkflowSample]:
        """``repeat_times`` samples for ``task`` (``payload`` is its parsed JSON payload)."""


class SingleTurnWorkflow(Workflow):
    """One chat prompt, ``repeat_times`` sampled answers in one engine call, each scored on its own."""

    @abstractmethod
    def messages(self, payload: Mapping[str, Any]) -> list[Message]:
        """The chat messages sent to the model."""

    def score_sample(self, completion: Completion, payload: Mapping[str, Any]) -> Reward:
        return self.score(completion.text, payload)

    def score_completions(self, completions: list[Completion], payload: Mapping[str, Any],
                          prompt: str) -> list[Reward | RewardFailure]:
        """Each completion's reward, or why it has none: a group reward (an LLM judge) scores them all in one
        call; a reward function scores them one by one (:meth:`score_sample`)."""
        if isinstance(self.reward_fn, GroupReward):
            return self.reward_fn.score_group(prompt, [c.text for c in completions], payload)
        return [self.score_sample(c, payload) for c in completions]

    def run(self, task, payload, engine, repeat_times, sampling):
        messages = self.messages(payload)
        completions = engine.generate([messages], sampling, n=repeat_times)[0]
        prompt_text = messages[-1]["content"]
        samples = []
        for completion, scored in zip(completions, self.score_completions(completions, payload, prompt_text)):
            failure = scored if isinstance(scored, RewardFailure) else None
            reward = Reward(0.0) if failure is not None else scored  # 0 is never trained on: the sample fails
            samples.append(
                WorkflowSample(
                    tokens=completion.prompt_ids + completion.response_ids,
                    prompt_length=len(completion.prompt_ids),
                    logprobs=list(completion.logprobs),
                    reward=reward.value,
                    truncated=completion.truncated,
                    prompt_text=prompt_text,
                    response_text=completion.text,
                    metrics={"response_length": float(len(completion.response_ids)), **reward.metrics},
                    info={"finish_reason": completion.finish_reason, **reward.info},
                    correct=reward.correct,
                    model_version=completion.model_version,
                    version_switches=list(completion.version_switches),
                    failure=failure,
                )
            )
        return samples


def add_versions(first: int | None, switches: list[tuple[int, int]], completion: Completion, offset: int) -> int:
    """A sample made of several completions (an episode's turns): add ``completion``'s versions, its tokens
    starting at response index ``offset``, to the sample's ``switches``; returns the sample's first version."""
    if first is None:
        first = completion.model_version
    elif completion.model_version != (switches[-1][1] if switches else first):
        switches.append((offset, completion.model_version))
    switches.extend((offset + index, version) for index, version in completion.version_switches)
    return first


def parse_payload(task: Task) -> dict[str, Any]:
    try:
        payload = json.loads(task.payload) if task.payload else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"payload is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ValueError(f"payload must be a JSON object, got {type(payload).__name__}")
    return payload


def chat_suffix_ids(
    engine: InferenceEngine,
    conversation_start: Sequence[Message],
    new_messages: Sequence[Message],
    after_eos: bool,
) -> list[int]:
    """Token ids that follow a model turn to append ``new_messages`` (e.g. an environment's reply) and open the
    next assistant turn, as the chat template writes them. The template is rendered around a placeholder
    assistant turn, so the ids the model actually sampled are kept as they are (re-tokenising a whole
    conversation can merge tokens differently). When the model's turn ended with the EOS token, the template's
    end-of-turn text is not repeated."""
    marker = "\x00streamrft-turn\x00"
    history = [*map(dict, conversation_start), {"role": "assistant", "content": marker}]
    rendered = engine.render_chat([*history, *map(dict, new_messages)], add_generation_prompt=True)
    suffix = rendered[rendered.rindex(marker) + len(marker) :]
    eos_text = engine.tokenizer.eos_token or ""
    if after_eos and eos_text and suffix.startswith(eos_text):
        suffix = suffix[len(eos_text) :]
    return engine.encode(suffix)
