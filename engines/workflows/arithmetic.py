r"""Single-turn math workflows.

``arithmetic`` -- payload ``{"question": "What is 3 + 4?", "answer": 7}`` (or ``{"a": 3, "b": 4}``, the question
and answer derived). Reward: ``exact_number`` on the last number of the response; with
``"format_weight": w`` in the payload, ``+ w * format`` (the response ends with its number).

``math_boxed`` -- payload ``{"question": ..., "answer": "\frac{1}{2}"}``; the model is asked to put its final
answer in ``\boxed{}``. Reward: ``boxed_match``; with ``format_weight``, ``+ w * format_boxed``.

Both accept optional ``"system"`` (a system message) and ``"instruction"`` (text appended to the question).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..inference.base import Completion, Message
from .base import SingleTurnWorkflow
from .registry import get_reward, register_workflow
from .rewards import Reward


class _MathWorkflow(SingleTurnWorkflow):
    format_reward: ClassVar[str]
    default_instruction: ClassVar[str] = ""

    def question(self, payload: Mapping[str, Any]) -> str:
        if "question" not in payload:
            raise KeyError("the task payload has no 'question'")
        return str(payload["question"])

    def messages(self, payload: Mapping[str, Any]) -> list[Message]:
        instruction = payload.get("instruction", self.default_instruction)
        content = self.question(payload) + (f" {instruction}" if instruction else "")
        system = payload.get("system")
        return ([{"role": "system", "content": str(system)}] if system else []) + [
            {"role": "user", "content": content}
        ]

    def score_sample(self, completion: Completion, payload: Mapping[str, Any]) -> Reward:
        base = self.score(completion.text, payload)
        weight = float(payload.get("format_weight", 0.0))
        if not weight:
            return base
        shaping = Reward.of(get_reward(self.format_reward)(completion.text, payload))
        return Reward(
            base.value + weight * shaping.value,
            correct=base.correct,
            metrics={**base.metrics, "reward/answer": base.value, "reward/format": shaping.value},
        )


@register_workflow("arithmetic")
class ArithmeticWorkflow(_MathWorkflow):
    default_reward = "exact_number"
    format_reward = "format"

    def question(self, payload: Mapping[str, Any]) -> str:
        if "question" not in payload and {"a", "b"} <= payload.keys():
            return f"What is {payload['a']} + {payload['b']}?"
        return super().question(payload)

    def score_sample(self, completion: Completion, payload: Mapping[str, Any]) -> Reward:
        if "answer" not in payload and {"a", "b"} <= payload.keys():
            payload = {**payload, "answer": int(payload["a"]) + int(payload["b"])}
        return super().score_sample(completion, payload)


@register_workflow("math_boxed")
class MathBoxedWorkflow(_MathWorkflow):
    default_reward = "boxed_match"
    format_reward = "format_boxed"
    default_instruction = "Put your final answer within \\boxed{}."
