"""Caps on the work one task may ask for: the one declaration of these knobs (the run config's ``limits:``
section extends :class:`WorkLimits`, ``streamrft/config/limits.py``, so a cap added here can be set from YAML
with no other edit). A task over a cap fails with :class:`OverLimit` (a WorkflowError, so the worker reports
FAILED with the reason) before or while it runs, instead of holding a worker for hours."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WorkLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    max_repeat_times: int = Field(default=256, ge=1, description="samples one task may ask for")
    max_turns: int = Field(default=32, ge=1,
                           description="model turns of one multi-turn episode: one that reaches it ends there "
                                       "(truncated); a task whose environment's own rules ask for more FAILS")
    max_prompt_tokens: int = Field(default=16384, ge=1, description="prompt tokens of one engine call")
    max_episode_tokens: int = Field(default=4096, ge=1,
                                    description="response tokens (model and environment turns) of one multi-turn "
                                                "episode; one that reaches it ends there (truncated)")

    def check_repeat_times(self, repeat_times: int) -> None:
        if repeat_times > self.max_repeat_times:
            raise OverLimit(f"the task asks for {repeat_times} samples; limits.max_repeat_times is "
                            f"{self.max_repeat_times}")

    def check_turns(self, turns: int) -> None:
        if turns > self.max_turns:
            raise OverLimit(f"the task asks for {turns} turns; limits.max_turns is {self.max_turns}")

    def check_prompt(self, n_tokens: int) -> None:
        if n_tokens > self.max_prompt_tokens:
            raise OverLimit(f"a prompt of {n_tokens} tokens; limits.max_prompt_tokens is {self.max_prompt_tokens}")


class OverLimit(ValueError):
    """The task asks for more than the run allows."""
