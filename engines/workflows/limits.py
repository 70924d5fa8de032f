"""Caps on the work one task may ask for. A task over a cap fails with :class:`OverLimit` (a WorkflowError,
so the worker reports FAILED with the reason) before or while it runs, instead of holding a worker for hours."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkLimits:
    max_repeat_times: int = 256
    max_turns: int = 32
    max_prompt_tokens: int = 16384
    max_episode_tokens: int = 4096

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
