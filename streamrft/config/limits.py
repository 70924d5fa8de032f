"""Caps on what one record may ask of the run. Work over a cap (a task asking for 10,000 samples, 500 turns,
a 100k-token prompt, a weights version that never comes) fails that request with the reason instead of
walking from worker to worker; a record over a size cap is dead-lettered where it is read."""
from __future__ import annotations

from pydantic import Field

from .base import Section


class LimitsConfig(Section):
    max_task_bytes: int = Field(default=1 << 20, ge=1024,
                                description="largest Task (payload included) the explorer takes; larger: DLQ")
    max_repeat_times: int = Field(default=256, ge=1, description="samples one task may ask for")
    max_turns: int = Field(default=32, ge=1,
                           description="model turns of one multi-turn episode: one that reaches it ends there "
                                       "(truncated); a task whose environment's own rules ask for more FAILS")
    max_episode_tokens: int = Field(default=4096, ge=1,
                                    description="response tokens (model and environment turns) of one multi-turn "
                                                "episode; one that reaches it ends there (truncated)")
    max_prompt_tokens: int = Field(default=16384, ge=1, description="prompt tokens of one engine call")
    max_version_wait_s: float = Field(default=600.0, gt=0,
                                      description="a request waiting longer for its min_model_version FAILS")
