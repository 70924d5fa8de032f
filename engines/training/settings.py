"""Settings of the training engine: a frozen dataclass, checked at construction (the trainer role builds it from
its pydantic config; nothing here imports the config layer)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..algorithms import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES


@dataclass(frozen=True)
class TrainingSettings:
    # optimiser (AdamW) and schedule
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping (the norm is still reported)
    lr_schedule: Literal["constant", "warmup_cosine"] = "constant"
    warmup_steps: int = 0  # linear warm-up, for both schedules
    total_steps: int = 0  # cosine horizon (required by warmup_cosine)
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    # batching and precision
    micro_batch_size: int = 4  # sequences per forward/backward; gradients accumulate over the step
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False
    temperature: float = 1.0  # logits are divided by it, as the rollout engine did when sampling
    # algorithm (registry names, see streamrft.engines.algorithms)
    advantage: str = "grpo"
    advantage_params: dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO clip-higher
    loss_agg: str = "token-mean"
    entropy_coef: float = 0.0  # entropy bonus: loss −= entropy_coef · agg(entropy)
    kl_coef: float = 0.0  # KL as a loss term: loss += kl_coef · agg(KL(π‖π_ref))
    kl_estimator: str = "k3"
    kl_penalty_coef: float = 0.0  # KL as a reward penalty before advantages
    kl_penalty_estimator: str = "k1"
    # off-policy handling
    recompute_old_logprobs: bool = True  # PPO ratio against the trainer's own logprobs (else the rollout's)
    tis: bool = False  # truncated IS on every experience (rollout/trainer mismatch); stale ones always get it
    tis_cap: float = 2.0

    def __post_init__(self) -> None:
        for registry, name, key in (
            (ADVANTAGES, self.advantage, "advantage"),
            (POLICY_LOSSES, self.policy_loss, "policy_loss"),
            (LOSS_AGGREGATIONS, self.loss_agg, "loss_agg"),
            (KL_ESTIMATORS, self.kl_estimator, "kl_estimator"),
            (KL_ESTIMATORS, self.kl_penalty_estimator, "kl_penalty_estimator"),
        ):
            if name not in registry:
                raise ValueError(f"{key}={name!r} is not one of {', '.join(registry.names())}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low ({self.clip_low}) and clip_high ({self.clip_high}) must be >= 0")
        if self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1 (a cap below 1 down-weights on-policy tokens), got {self.tis_cap}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule == "warmup_cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"lr_schedule=warmup_cosine needs total_steps ({self.total_steps}) > warmup_steps "
                f"({self.warmup_steps}); set total_steps to the planned number of optimiser steps"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def needs_reference(self) -> bool:
        """A reference model is loaded only when some KL term is on."""
        return self.kl_coef > 0 or self.kl_penalty_coef > 0
