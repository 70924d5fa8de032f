"""Auxiliary models beside the rollout model: what workflows and rewards may call by name (a judge, a teacher).

The rollout worker builds the engines from the run's ``auxiliary_models`` (engines/ reads no config) and hands
them to its :class:`~.scheduler.WorkflowPool` (``attach``), which puts each on a lane of its own driven by the
worker's engine thread and gives every workflow the same :class:`WorkflowContext`:

- ``context.auxiliary["judge"]`` is that model as an ``InferenceEngine`` (``generate`` queues the call and waits:
  the calls of every workflow batch together, see ``scheduler``); a name the run does not have raises
  :class:`UnknownAuxiliaryModel`, whose message names the ones it has, and the request FAILS with it;
- ``context.judge`` are the settings of the ``judge`` reward (``judge.JudgeSettings``);
- ``context.teacher``, when the run distils, scores every sample's tokens under the teacher
  (:class:`Teacher`): its logprobs are stored per response token with the sample (``Experience.teacher_logprobs``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..inference.base import InferenceEngine
from ..settings.judge import JudgeSettings


class Sequenced(Protocol):
    """What a teacher reads of a sample (a :class:`~.base.WorkflowSample`): its tokens, the prompt first."""

    tokens: Sequence[int]
    prompt_length: int


class UnknownAuxiliaryModel(KeyError):
    """A workflow, a reward or a task named an auxiliary model the run does not have."""

    def __str__(self) -> str:  # KeyError quotes its argument; this message is a sentence
        return str(self.args[0])


class AuxiliaryModels(Mapping[str, InferenceEngine]):
    """The run's auxiliary models by name, as workflows call them."""

    def __init__(self, engines: Mapping[str, InferenceEngine] | None = None) -> None:
        self._engines = dict(engines or {})

    def __getitem__(self, name: str) -> InferenceEngine:
        return self.engine(name)

    def engine(self, name: str, wanted_by: str = "") -> InferenceEngine:
        """The model ``name``; :class:`UnknownAuxiliaryModel` naming the ones there are when there is none."""
        if name not in self._engines:
            who = f"{wanted_by} asks for" if wanted_by else "no"
            have = ", ".join(sorted(self._engines)) or "none"
            raise UnknownAuxiliaryModel(f"{who} auxiliary model {name!r}; this run has: {have} (add it under "
                                        "auxiliary_models in the run config, or name one of these)")
        return self._engines[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)


# call(sequences, prompt_lengths, temperature) -> per sequence, the logprob of each token after its prompt
ScoreCall = Callable[[list[list[int]], list[int], float], list[list[float]]]


@dataclass(frozen=True)
class Teacher:
    """The teacher of on-policy distillation: its logprobs of the tokens a sample already has (teacher forcing:
    prompt + response through the teacher, one forward, nothing sampled). The teacher must share the policy's
    tokenizer (the worker checks it at start: ``teacher.check_same_tokenizer``)."""

    name: str
    tokenizer: Any
    score: ScoreCall

    def logprobs(self, samples: Sequence[Sequenced], temperature: float) -> list[list[float]]:
        """Per sample, ``log_softmax(teacher_logits / temperature)`` of each response token (``temperature``: the
        one the policy's logprobs were taken at, so the two compare token by token)."""
        if not samples:
            return []
        return self.score([list(s.tokens) for s in samples], [s.prompt_length for s in samples], temperature)


@dataclass(frozen=True)
class WorkflowContext:
    """What a workflow and its reward may use beyond the policy engine; set on each workflow by
    ``build_workflow`` (``Workflow.context``)."""

    auxiliary: AuxiliaryModels = field(default_factory=AuxiliaryModels)
    judge: JudgeSettings = field(default_factory=JudgeSettings)
    teacher: Teacher | None = None

    @classmethod
    def of(cls, auxiliary: AuxiliaryModels, judge: JudgeSettings | None = None,
           teacher: Teacher | None = None) -> "WorkflowContext":
        return cls(auxiliary, judge or JudgeSettings(), teacher)
