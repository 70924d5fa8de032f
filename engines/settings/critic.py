"""``trainer.critic``: the value model of PPO with a critic (``trainer.algorithm.advantage: gae``), trained by the
trainer beside the policy with an optimiser, schedule and clipping of its own (:mod:`streamrft.engines.training.
critic`). The explorer, the workers and the records know nothing of it: values are computed at training time."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CriticSettings(BaseModel):
    """``trainer.critic.<key>``; used only when the advantage is ``gae`` (the run config rejects it otherwise).
    AdamW's betas and eps, the micro-batch size, the precision and gradient checkpointing are the trainer's."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    model_path: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="a Hugging Face model directory whose backbone (with a new value head) is the critic, e.g. a "
                    "smaller model of the same tokenizer; null = a copy of the policy's own backbone")
    lr: float = Field(default=1e-5, gt=0, description="the critic's AdamW learning rate (veRL critic.optim.lr)")
    weight_decay: float = Field(default=0.01, ge=0, description="the critic's AdamW weight decay")
    max_grad_norm: float | None = Field(default=1.0, gt=0, description="clip the critic's gradient norm; null = "
                                                                       "no clipping (still reported)")
    lr_schedule: Literal["constant", "warmup_cosine"] = Field(
        default="constant", description="the critic's lr schedule; warmup_cosine's horizon is total_steps")
    warmup_steps: int = Field(default=0, ge=0, description="linear lr warm-up of the critic, in its steps")
    total_steps: int | None = Field(default=None, ge=1, description="the critic's cosine horizon; null = "
                                                                    "trainer.total_steps")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="the critic's cosine floor, as a fraction "
                                                                     "of its lr")
    cliprange_value: float | None = Field(
        default=0.5, gt=0, description="value clipping: a prediction moves at most this far from the value the "
                                       "advantages were computed with (veRL critic.cliprange_value); null = off")
    critic_warmup: int = Field(default=0, ge=0, description="the first training steps train the critic alone "
                                                            "(the policy waits for a useful baseline)")
