"""The ``judge`` reward's settings (the run config's ``judge:`` section extends :class:`JudgeSettings`;
:mod:`streamrft.engines.workflows.judge` is the reward)."""
from __future__ import annotations

import re
import string
import zlib

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_TEMPLATE = (
    "Rate how well the response answers the question, from {min_score} to {max_score}.\n\n"
    "Question: {question}\n\nResponse: {response}\n\n"
    "End your reply with 'Score: <number>'."
)
DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"


class JudgeSettings(BaseModel):
    """The ``judge`` reward's settings (the run config's ``judge:`` section extends this class)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    model: str = Field(default="judge", min_length=1, description="the auxiliary model that judges")
    prompt_template: str = Field(default=DEFAULT_TEMPLATE,
                                 description="the judge's prompt: fields question, response, min_score, "
                                             "max_score and the task payload's keys")
    system_prompt: str = Field(default="", description="a system message before the prompt (none when empty)")
    score_pattern: str = Field(default=DEFAULT_PATTERN,
                               description="regex; its last match's first group is the score")
    min_score: float = Field(default=0.0, description="the lowest score the judge may give (reward 0); a score "
                                                      "outside [min_score, max_score] fails the reward")
    max_score: float = Field(default=10.0, description="the highest score the judge may give (reward 1); above "
                                                       "min_score")
    pass_score: float | None = Field(default=None, description="scores from here on count as correct; default "
                                                               "max_score")
    max_tokens: int = Field(default=64, ge=1, description="the judge's answer length")
    temperature: float = Field(default=0.0, ge=0, description="0 = greedy")
    seed: int | None = Field(default=None, description="with temperature > 0: each judge prompt is sampled with "
                                                       "this seed + a hash of the prompt (the same answer to the "
                                                       "same prompt, whatever the batch)")

    @field_validator("prompt_template")
    @classmethod
    def _named_fields(cls, template: str) -> str:
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as exc:
            raise ValueError(f"prompt_template is not a format string ({exc}); write a literal brace as {{{{ or "
                             "}}") from None
        if any(not name or name[0].isdigit() for name in fields):
            raise ValueError("prompt_template fields need names ({question}, {response}, a payload key), not {} "
                             "or {0}")
        return template

    @field_validator("score_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"score_pattern is not a regular expression: {exc}") from None
        return pattern

    @model_validator(mode="after")
    def _range(self) -> "JudgeSettings":
        if self.max_score <= self.min_score:
            raise ValueError(f"max_score ({self.max_score}) must be above min_score ({self.min_score})")
        if self.pass_score is not None and not self.min_score <= self.pass_score <= self.max_score:
            raise ValueError(f"pass_score ({self.pass_score}) must lie in [min_score, max_score]")
        return self

    def seed_for(self, prompt: str) -> int | None:
        """The seed the judge answers ``prompt`` with: its own per prompt, so two prompts never share one random
        stream (a shared one would give every answer of a batch the same luck); None when unseeded."""
        return None if self.seed is None else self.seed + zlib.crc32(prompt.encode())
