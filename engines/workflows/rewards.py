"""Built-in reward functions and the answer parsing they share.

A reward function is ``fn(response: str, payload: Mapping) -> Reward | float``: it scores one response text
against the task's payload (which holds the reference ``answer``). Register more with
:func:`~.registry.register_reward` or the ``streamrft.rewards`` entry-point group.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from .registry import register_reward

if TYPE_CHECKING:
    from .auxiliary import WorkflowContext


@dataclass(frozen=True, slots=True)
class Reward:
    """A score. ``correct`` says whether the answer was right (accuracy metrics), independent of shaping terms
    such as a format bonus; ``metrics`` are extra per-sample numbers (e.g. ``reward/format``), ``info`` extra
    strings (e.g. a judge's answer), both kept with the sample's experience."""

    value: float
    correct: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, result: "Reward | float | int | bool") -> "Reward":
        """Accept what a plugin returns: a Reward, or a bare number (correct when > 0)."""
        if isinstance(result, Reward):
            return result
        if isinstance(result, (int, float)):
            return cls(float(result), correct=float(result) > 0)
        raise TypeError(f"a reward function must return a Reward or a number, got {type(result).__name__}")


class RewardFailure(ValueError):
    """A sample its reward could not score (a judge's answer with no score in it). The sample fails alone: it is
    not trained on, and the request's result says why; it never gets a made-up 0. ``source`` names the reward
    (``judge``), for the failure counters."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class GroupReward(ABC):
    """A reward that scores a task's samples together and may call the run's auxiliary models (an LLM judge).

    Registered like a reward function (``@register_reward("name")``, on the class). ``build_workflow`` makes one
    per task from the workflow's :class:`~.auxiliary.WorkflowContext` and the task's payload, so a model the run
    does not have fails the task before anything is generated; :meth:`score_group` then scores all of its samples
    in one go (one batched model call rather than one per sample)."""

    def __init__(self, context: "WorkflowContext", payload: Mapping[str, Any]) -> None:
        self.context = context

    @abstractmethod
    def score_group(self, prompt: str, responses: Sequence[str],
                    payload: Mapping[str, Any]) -> list[Reward | RewardFailure]:
        """Per response, its reward, or the :class:`RewardFailure` that says why it has none. ``prompt`` is what
        the model was asked (the last user message)."""


# A number as people write it: optional sign, thousands separators (1,000), decimals, or a fraction a/b.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")


def parse_number(text: str) -> Fraction | None:
    """The value of one number written as text ("7", "-3", "1,000", "2.50", "3/4"), else None."""
    text = text.strip().rstrip(".")
    match = _NUMBER.fullmatch(text)
    return _value(match.group(0)) if match else None


def _value(token: str) -> Fraction | None:
    token = token.replace(",", "").replace(" ", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The last number in ``text`` (see :func:`parse_number` for the forms), or None when there is none."""
    for match in reversed(list(_NUMBER.finditer(text))):
        value = _value(match.group(0))
        if value is not None:
            return value
    return None


def reference_number(payload: Mapping[str, Any]) -> Fraction:
    """The payload's ``answer`` as a number; a missing or non-numeric answer is a task error."""
    if "answer" not in payload:
        raise KeyError("the task payload has no 'answer'")
    answer = payload["answer"]
    value = _value(str(answer)) if isinstance(answer, (int, float, str)) else None
    if value is None:
        raise ValueError(f"the task's answer {answer!r} is not a number")
    return value


def last_boxed(text: str) -> str | None:
    r"""Contents of the last ``\boxed{...}`` (braces balanced, so ``\boxed{\frac{1}{2}}`` works), else None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 0, start + len("\\boxed")
        for i in range(start + len("\\boxed"), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def normalize_answer(text: str) -> str:
    r"""A canonical string for comparing math answers: no spaces or ``$``, ``\frac{a}{b}`` as ``a/b``,
    ``\text{x}`` as ``x``, no ``\left``/``\right``, no trailing period."""
    text = _TEXT.sub(r"\1", str(text))
    text = _FRAC.sub(r"(\1)/(\2)", text)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", " "):
        text = text.replace(junk, "")
    text = re.sub(r"\((-?\d+)\)", r"\1", text)  # (1)/(2) -> 1/2
    return text.rstrip(".")


def answers_match(given: str, reference: Any) -> bool:
    """Equal as normalised strings, or equal as numbers when both parse as numbers."""
    a, b = normalize_answer(given), normalize_answer(str(reference))
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


@register_reward("exact_number")
def exact_number(response: str, payload: Mapping[str, Any]) -> Reward:
    """1.0 when the last number in the response equals the payload's ``answer``, else 0.0. The reference is
    read first, so a task without a usable answer fails whatever the model wrote."""
    expected = reference_number(payload)
    got = final_number(response)
    correct = got is not None and got == expected
    return Reward(1.0 if correct else 0.0, correct=correct)


@register_reward("boxed_match")
def boxed_match(response: str, payload: Mapping[str, Any]) -> Reward:
    r"""1.0 when the last ``\boxed{...}`` in the response matches the payload's ``answer`` (see
    :func:`answers_match`), else 0.0."""
    if "answer" not in payload:
        raise KeyError("the task payload has no 'answer'")
    boxed = last_boxed(response)
    correct = boxed is not None and answers_match(boxed, payload["answer"])
    return Reward(1.0 if correct else 0.0, correct=correct, metrics={"reward/has_boxed": float(boxed is not None)})


_ENDS_WITH_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?\s*[.!]?\s*$")


@register_reward("format")
def format_number(response: str, payload: Mapping[str, Any]) -> Reward:
    """1.0 when the response ends with its answer, a number (optionally followed by '.' or '!'), else 0.0.
    A shaping term: ``correct`` stays False."""
    return Reward(1.0 if _ENDS_WITH_NUMBER.search(response.strip()) else 0.0)


@register_reward("format_boxed")
def format_boxed(response: str, payload: Mapping[str, Any]) -> Reward:
    r"""1.0 when the response has exactly one ``\boxed{...}``, else 0.0. A shaping term."""
    return Reward(1.0 if response.count("\\boxed{") == 1 and last_boxed(response) is not None else 0.0)
