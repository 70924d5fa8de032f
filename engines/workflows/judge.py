"""LLM-as-judge: ``reward_fn: judge`` scores each response with an auxiliary model, for tasks with no exact checker.

For each sample the judge model is asked ``prompt_template`` (a ``str.format`` template; its fields are
``question`` -- what the policy was asked --, ``response``, ``min_score``, ``max_score`` and every key of the task's
payload, e.g. ``{answer}`` for a reference or ``{rubric}``), greedily by default. Its answer is parsed with
``score_pattern``: the last match's first group (the whole match when the pattern has no group) is the score,
which must lie in ``[min_score, max_score]``; the reward is the score scaled to [0, 1], and the sample counts as
correct from ``pass_score`` on (default: ``max_score``).

**Failures.** A judge answer with no score in it, or a score out of range, fails *that sample* with the reason
(:class:`~.rewards.RewardFailure`): the sample is not trained on and the request's result names it, while the
group's other samples stand -- one unparseable answer costs one sample, not the ``repeat_times`` generated with
it, and a small judge that misformats now and then does not stall a run. A task naming a judge model the run does
not have, a template field its payload lacks, or a judge engine that fails the call fail *the request*: those are
errors of the task or of the deployment, not of one answer, and every sample would fail the same way.

The judge model is ``judge.model`` (an entry of ``auxiliary_models``); a task may name another with
``"judge_model"`` in its payload. All samples of a task go to the judge in one call, and the calls of every
workflow that is judging share the judge's batch (``scheduler``).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..inference.base import Message, SamplingParams
from ..settings.judge import JudgeSettings
from .registry import register_reward
from .rewards import GroupReward, Reward, RewardFailure

if TYPE_CHECKING:
    from .auxiliary import WorkflowContext

ANSWER_SHOWN = 300  # characters of a judge's answer kept in a failure's reason and in the sample's info


def judge_sampling(settings: JudgeSettings, prompt: str) -> SamplingParams:
    """How the judge answers ``prompt`` (its seed per prompt: :meth:`JudgeSettings.seed_for`)."""
    return SamplingParams(temperature=settings.temperature, max_tokens=settings.max_tokens,
                          seed=settings.seed_for(prompt))


def parse_score(answer: str, settings: JudgeSettings) -> Reward:
    """The reward a judge's ``answer`` gives (see the module docstring), or :class:`RewardFailure` saying why
    it gives none."""
    matches = list(re.finditer(settings.score_pattern, answer))
    if not matches:
        raise RewardFailure("judge", f"no score in the judge's answer (score_pattern {settings.score_pattern!r}): "
                                     f"{answer[:ANSWER_SHOWN]!r}")
    last = matches[-1]
    text = last.group(1) if last.re.groups else last.group(0)
    try:
        score = float(text)
    except (TypeError, ValueError):
        raise RewardFailure("judge", f"the judge's score {text!r} is not a number") from None
    if not settings.min_score <= score <= settings.max_score:
        raise RewardFailure("judge", f"the judge's score {score:g} is outside [{settings.min_score:g}, "
                                     f"{settings.max_score:g}]: {answer[:ANSWER_SHOWN]!r}")
    passing = settings.max_score if settings.pass_score is None else settings.pass_score
    value = (score - settings.min_score) / (settings.max_score - settings.min_score)
    return Reward(value, correct=score >= passing, metrics={"judge/score": score},
                  info={"judge_answer": answer[:ANSWER_SHOWN]})


@register_reward("judge")
class JudgeReward(GroupReward):
    """``reward_fn: judge`` (see the module docstring)."""

    def __init__(self, context: "WorkflowContext", payload: Mapping[str, Any]) -> None:
        super().__init__(context, payload)
        self.settings = context.judge
        name = str(payload.get("judge_model", self.settings.model))
        self.engine = context.auxiliary.engine(name, wanted_by="reward 'judge'")
        self._render("", "", payload)  # a field the payload lacks fails the task now, before any generation

    def _render(self, question: str, response: str, payload: Mapping[str, Any]) -> str:
        fields = {**payload, "question": question, "response": response,
                  "min_score": f"{self.settings.min_score:g}", "max_score": f"{self.settings.max_score:g}"}
        try:
            return self.settings.prompt_template.format_map(fields)
        except KeyError as exc:
            raise ValueError(f"judge.prompt_template names {{{exc.args[0]}}}, which the task payload does not "
                           f"have (it has: {', '.join(sorted(payload)) or 'nothing'})") from None

    def messages(self, question: str, response: str, payload: Mapping[str, Any]) -> list[Message]:
        system = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return [*system, {"role": "user", "content": self._render(question, response, payload)}]

    def score_group(self, prompt: str, responses: Sequence[str],
                    payload: Mapping[str, Any]) -> list[Reward | RewardFailure]:
        prompts = [self.messages(prompt, response, payload) for response in responses]
        params = [judge_sampling(self.settings, messages[-1]["content"]) for messages in prompts]
        answers = self.engine.generate(prompts, params, n=1)
        return [_scored(completion.text, self.settings) for (completion,) in answers]


def _scored(answer: str, settings: JudgeSettings) -> Reward | RewardFailure:
    try:
        return parse_score(answer, settings)
    except RewardFailure as failure:
        return failure
