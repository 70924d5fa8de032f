"""Settings of the training engine: the one declaration of every training knob.

The knobs come in the two groups a run's YAML nests them in: :class:`OptimizerSettings` (``trainer.<key>``) and
:class:`AlgorithmSettings` (``trainer.algorithm.<key>``). The run config's trainer section extends these classes
(``streamrft/config/roles.py``), so a knob added here can be set from YAML with no other edit, and its default,
bounds and checks are the same on both sides. :class:`TrainingSettings`, what the engine takes, is both groups
plus ``temperature``, which a run derives from its rollout sampling. Nothing here imports the config layer.

Algorithm names are checked here, once, against the registries of :mod:`streamrft.engines.algorithms.catalog`
(plugins installed by entry point included) without importing their functions: nothing here loads torch, except
``advantage_params``, which are checked against the named function's signature and so import its module.
"""
from __future__ import annotations

import inspect
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ..algorithms.catalog import (ADVANTAGES, IMPORTANCE_CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                                  PREFERENCE_LOSSES)
from ..algorithms.registry import Registry
from .critic import CriticSettings

# Arguments every advantage function receives from the engine; ``advantage_params`` supplies the others.
ADVANTAGE_INPUTS = ("rewards", "mask", "group_ids", "token_rewards")
# Per-token inputs the engine gives an advantage function only when it declares them (``distill``).
OPTIONAL_ADVANTAGE_INPUTS = ("teacher_logprobs", "behaviour_logprobs")
# What the engine gives an advantage function that declares it when a critic trains (``gae``): its values [B, R].
CRITIC_ADVANTAGE_INPUTS = ("values",)
# What the records carry for the estimators that declare it (:mod:`streamrft.schemas.experience_extras`): the
# greedy sample's score (``remax``) and each token's model turn and that turn's state (``gigpo``, ``step_grpo``).
RECORD_ADVANTAGE_INPUTS = ("greedy_rewards", "turn_index", "turn_state")
# Arguments every policy loss receives; ``clip_ratio_c`` and ``policy_loss_params`` supply the others.
POLICY_LOSS_INPUTS = ("logprobs", "old_logprobs", "advantages", "mask", "clip_low", "clip_high")


def _registered(registry: Registry) -> AfterValidator:
    """A validator accepting only names in ``registry`` (built-in or plugin)."""

    def check(name: str) -> str:
        if name not in registry:
            raise ValueError(f"no {registry.kind} is registered as {name!r}; {registry.choices()}")
        return name

    return AfterValidator(check)


AdvantageName = Annotated[str, _registered(ADVANTAGES)]
PolicyLossName = Annotated[str, _registered(POLICY_LOSSES)]
LossAggregationName = Annotated[str, _registered(LOSS_AGGREGATIONS)]
KlEstimatorName = Annotated[str, _registered(KL_ESTIMATORS)]
PreferenceLossName = Annotated[str, _registered(PREFERENCE_LOSSES)]
ImportanceCorrectionName = Annotated[str, _registered(IMPORTANCE_CORRECTIONS)]


def _unaccepted(fn, given: set[str], inputs: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the keywords of ``given`` that ``fn`` does not take, the ones it does take besides ``inputs``)."""
    parameters = inspect.signature(fn).parameters
    accepted = [name for name in parameters if name not in inputs]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return [], accepted
    return sorted(given - set(accepted)), accepted


class EngineSettings(BaseModel):
    """Frozen, and unknown keys are errors (a misspelt knob fails instead of silently keeping its default)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class OptimizerSettings(EngineSettings):
    """AdamW, its learning-rate schedule, batching and precision (``trainer.<key>`` in a run's YAML), and the
    critic's own (``trainer.critic``)."""

    lr: float = Field(default=1e-6, gt=0, description="AdamW learning rate (the peak of warmup_cosine)")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW β1, β2, each in [0, 1)")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW ε, added to the denominator for stability")
    max_grad_norm: float | None = Field(default=1.0, gt=0,
                                        description="clip the gradient norm; null = no clipping (still reported)")
    lr_schedule: Literal["constant", "warmup_cosine"] = Field(
        default="constant", description="constant (after warmup_steps) or warmup_cosine (linear warm-up, then a "
                                        "cosine decay to min_lr_ratio · lr at total_steps)")
    warmup_steps: int = Field(default=0, ge=0, description="linear warm-up, for both schedules")
    total_steps: int | None = Field(default=None, ge=1,
                                    description="optimiser steps to train (the trainer stops there); the cosine "
                                                "horizon, required by warmup_cosine")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="cosine floor, as a fraction of lr")
    micro_batch_size: int = Field(default=8, ge=1,
                                  description="sequences per forward/backward; gradients accumulate over the step")
    max_tokens_per_micro_batch: int | None = Field(
        default=None, ge=1, description="fill each forward/backward with rows up to this many tokens instead of "
                                        "micro_batch_size rows (padding counted, unless pack_sequences); a longer "
                                        "sequence runs alone in its own (veRL use_dynamic_bsz + "
                                        "ppo_max_token_len_per_gpu); null = micro_batch_size rows")
    pack_sequences: bool = Field(
        default=False, description="lay each micro-batch's sequences end to end in one row, without padding "
                                   "(positions restart per sequence, attention stays within each: varlen "
                                   "flash-attention, or a block-diagonal mask under sdpa/eager)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] | None = (
        Field(default=None, description="the trained models' attention kernel (transformers' attn_implementation); "
                                        "flash_attention_2 runs packed sequences as varlen attention and needs the "
                                        "flash-attn package and a GPU; null = transformers' default (sdpa)"))
    mixed_precision: Literal["auto", "bf16", "no"] = Field(
        default="auto", description="bf16 autocast of the forward/backward (master weights and optimizer stay "
                                    "fp32); auto = bf16 on CUDA, and on a CPU where a probe at start measures "
                                    "bf16 matmuls at least 1.3x as fast as fp32 (bf16 matrix units: "
                                    "AVX512-BF16, AMX), else fp32")
    gradient_checkpointing: bool = Field(default=False,
                                         description="recompute activations in the backward: less memory, slower")
    critic: CriticSettings = Field(default=CriticSettings(),
                                   description="the value model of advantage: gae (PPO with a critic): its model, "
                                               "optimiser, schedule, value clipping and warm-up")

    @property
    def model_load_kwargs(self) -> dict[str, Any]:
        """Keywords of ``from_pretrained`` for the trained models."""
        return {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimizerSettings":
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must both be in [0, 1) (AdamW's moment decay rates), got {list(self.betas)}")
        return self

    @model_validator(mode="after")
    def _cosine_has_a_horizon(self) -> "OptimizerSettings":
        if self.lr_schedule == "warmup_cosine" and (self.total_steps or 0) <= self.warmup_steps:
            raise ValueError(
                f"lr_schedule=warmup_cosine needs total_steps ({self.total_steps}) > warmup_steps "
                f"({self.warmup_steps}); set total_steps to the planned number of optimiser steps, or use "
                "lr_schedule: constant"
            )
        return self

    @model_validator(mode="after")
    def _critic_cosine_has_a_horizon(self) -> "OptimizerSettings":
        c = self.critic
        if c.lr_schedule == "warmup_cosine" and (c.total_steps or self.total_steps or 0) <= c.warmup_steps:
            raise ValueError(
                f"trainer.critic.lr_schedule=warmup_cosine needs trainer.critic.total_steps (or trainer.total_steps) "
                f"above trainer.critic.warmup_steps ({c.warmup_steps}); set one of them, or use lr_schedule: constant"
            )
        return self

    @property
    def critic_schedule(self) -> CriticSettings:
        """The critic's settings with its cosine horizon resolved (its own total_steps, else the trainer's)."""
        if self.critic.total_steps is not None or self.total_steps is None:
            return self.critic
        return self.critic.model_copy(update={"total_steps": self.total_steps})


class AlgorithmSettings(EngineSettings):
    """Advantages, policy loss, KL and importance sampling (``trainer.algorithm.<key>`` in a run's YAML)."""

    advantage: AdvantageName = Field(
        default="grpo", description="the advantage estimator: a name in the registry of "
                                    "engines/algorithms/catalog.py (grpo, rloo, gae, ...; docs/algorithms.md) or "
                                    "a plugin's (entry point streamrft.advantages)")
    advantage_params: dict[str, Any] = Field(default_factory=dict,
                                             description="keyword arguments of the advantage function")
    policy_loss: PolicyLossName = Field(
        default="ppo_clip", description="the policy loss: a name in the registry of engines/algorithms/catalog.py "
                                        "(ppo_clip, gspo, cispo, ...) or a plugin's (entry point "
                                        "streamrft.policy_losses)")
    policy_loss_params: dict[str, Any] = Field(default_factory=dict,
                                               description="keyword arguments of the policy loss (sapo: tau_pos, "
                                                           "tau_neg; opmd: tau; topr: threshold)")
    clip_low: float = Field(default=0.2, ge=0, description="ε_low: the ratio's lower bound is 1 − clip_low "
                                                           "(veRL/Trinity clip_ratio_low); cispo: ≥ 1 = no bound")
    clip_high: float = Field(default=0.2, ge=0, description="ε_high: the upper bound is 1 + clip_high; > clip_low: "
                                                            "DAPO clip-higher (veRL/Trinity clip_ratio_high)")
    clip_ratio_c: float | None = Field(default=None, gt=1,
                                       description="dual-clip PPO: a negative advantage's loss is bounded by "
                                                   "c·|A| (ppo_clip, decoupled_ppo); null = off (veRL's 3.0 is "
                                                   "a common value)")
    gae_gamma: float = Field(default=1.0, ge=0, le=1, description="advantage gae: the discount γ over response "
                                                                  "tokens (veRL algorithm.gamma)")
    gae_lambda: float = Field(default=1.0, ge=0, le=1, description="advantage gae: λ, the bias/variance trade-off "
                                                                   "of GAE (veRL algorithm.lam)")
    gigpo_step_weight: float = Field(default=1.0, ge=0, description="advantage gigpo: ω, the weight of the "
                                                                     "step-level (anchor-state) advantage added to "
                                                                     "the episode-level one")
    loss_agg: LossAggregationName = Field(
        default="token-mean", description="how per-token losses become one: token-mean (the mean over tokens), "
                                          "seq-mean-token-sum, seq-mean-token-mean, or a plugin's")
    entropy_coef: float = Field(default=0.0, description="entropy bonus: loss −= entropy_coef · agg(entropy)")
    kl_coef: float = Field(default=0.0, ge=0, description="KL as a loss term: loss += kl_coef · agg(KL(π‖π_ref))")
    kl_estimator: KlEstimatorName = Field(default="k3", description="estimator of the KL loss term (k1, k2, k3; "
                                                                 "Schulman's approximations)")
    kl_penalty_coef: float = Field(default=0.0, ge=0, description="KL as a reward penalty before advantages")
    kl_penalty_estimator: KlEstimatorName = Field(default="k1", description="estimator of the KL reward penalty "
                                                                         "(k1, k2, k3)")
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        default="fixed", description="adaptive: kl_penalty_coef is the initial coefficient, moved after each step "
                                     "toward target_kl (Ziegler et al. 2019; veRL kl_ctrl.type)")
    target_kl: float = Field(default=0.1, gt=0, description="adaptive kl_ctrl: the per-token KL to hold")
    kl_horizon: int = Field(default=10_000, ge=1, description="adaptive kl_ctrl: samples over which the "
                                                               "coefficient closes the gap to target_kl")
    # the first forward of a batch that trains one update gives the old logprobs for free; more updates cost one
    # more forward pass (training/proximal.py)
    recompute_old_logprobs: bool = Field(
        default=True, description="true: the PPO ratio's denominator is the trainer's own logprob under the "
                                  "weights before the step; false: the rollout engine's logprobs (exact up to "
                                  "numerics when rollouts are on-policy)")
    tis: bool = Field(default=False, description="the importance correction (is_correction) on every experience "
                                                 "(rollout/trainer mismatch); stale ones always get it")
    is_correction: ImportanceCorrectionName = Field(
        default="tis", description="how the sampler/trainer ratio reweights the loss: tis (per token, truncated "
                                   "at tis_cap), icepop (per token, masked outside [is_mask_low, is_mask_high]), "
                                   "seq_tis / seq_mis (the sequence's ratio), geo_tis / geo_mis (its geometric "
                                   "mean); plugins by the entry point streamrft.importance_corrections")
    tis_cap: float = Field(default=2.0, ge=1, description="the truncation cap of *_tis; a cap below 1 would "
                                                          "down-weight on-policy tokens")
    is_mask_low: float = Field(default=0.5, ge=0, description="*_mis and icepop: ratios below this are masked")
    is_mask_high: float = Field(default=2.0, gt=1, description="*_mis and icepop: ratios above this are masked")
    mask_truncated: bool = Field(default=False,
                                 description="keep truncated samples (cut by max_tokens, or a multi-turn episode cut "
                                             "by its turn or token budget) out of the loss; their rewards still "
                                             "count in their group's baseline")
    distill_coef: float = Field(default=0.0, ge=0,
                                description="on-policy distillation beside the task reward: adds distill_coef × "
                                            "the distill advantage (teacher − behaviour logprob, per token) to "
                                            "the advantage; advantage: distill is distillation alone")
    # Supervised experiences (objective SFT / DPO, ``streamrft data produce``): SFT rows always take the negative
    # log-likelihood of their assistant tokens; DPO pairs take this loss against the reference logprobs their
    # records carry (engines/training/supervised.py).
    preference_loss: PreferenceLossName = Field(default="dpo", description="dpo (sigmoid) or ipo (squared); "
                                                "plugins by the entry point streamrft.preference_losses")
    dpo_beta: float = Field(default=0.1, gt=0, description="β of the preference loss: how far the policy may move "
                                                          "from the reference (larger = less far)")
    sft_loss: Literal["sft", "sft_phi"] = Field(default="sft", description="the loss of SFT rows: sft (negative "
                                                                          "log-likelihood) or sft_phi (CHORD-φ's "
                                                                          "p·(1 − p) token weights)")
    # CHORD (Zhang et al. 2025): the SFT rows of trainer.mix weigh μ and the RL rows 1 − μ, μ on a schedule
    mix_weighting: Literal["rows", "chord"] = Field(
        default="rows", description="rows: each objective weighs its share of the step's rows; chord: SFT rows "
                                    "weigh μ(step) and RL rows 1 − μ (DPO rows keep their share)")
    chord_mu_peak: float = Field(default=0.1, ge=0, le=1, description="chord: μ after the warm-up")
    chord_mu_valley: float = Field(default=0.1, ge=0, le=1, description="chord: μ after the decay")
    chord_mu_warmup_steps: int = Field(default=0, ge=0, description="chord: steps of the linear rise of μ from 0")
    chord_mu_decay_steps: int = Field(default=0, ge=0, description="chord: steps of the cosine decay of μ from "
                                                                   "chord_mu_peak to chord_mu_valley")

    @property
    def reweights_every_row(self) -> bool:
        """Behaviour importance weights on every experience, not only on stale ones."""
        return self.tis or self.policy_loss == "decoupled_ppo"

    @model_validator(mode="after")
    def _decoupled_needs_the_proximal_policy(self) -> "AlgorithmSettings":
        if self.policy_loss == "decoupled_ppo" and not self.recompute_old_logprobs:
            raise ValueError("policy_loss decoupled_ppo takes its clip against the trainer's current weights, "
                             "which needs recompute_old_logprobs: true")
        return self

    @model_validator(mode="after")
    def _advantage_params_are_accepted(self) -> "AlgorithmSettings":
        """A misspelt parameter fails here, at load, instead of with a TypeError at the first training step."""
        if not self.advantage_params:
            return self
        if self.advantage == "gigpo" and "step_weight" in self.advantage_params:
            raise ValueError("advantage gigpo takes ω from trainer.algorithm.gigpo_step_weight, not from "
                             "advantage_params")
        if self.uses_critic and {"gamma", "lam"} & set(self.advantage_params):
            raise ValueError("advantage gae takes γ and λ from trainer.algorithm.gae_gamma and gae_lambda, not "
                             "from advantage_params")
        unknown, accepted = _unaccepted(ADVANTAGES.get(self.advantage), set(self.advantage_params),
                                        ADVANTAGE_INPUTS + OPTIONAL_ADVANTAGE_INPUTS + CRITIC_ADVANTAGE_INPUTS
                                        + RECORD_ADVANTAGE_INPUTS)
        if unknown:
            raise ValueError(
                f"advantage_params {unknown} are not parameters of advantage {self.advantage!r}; it takes "
                f"{', '.join(accepted) or 'none'}"
            )
        return self

    @model_validator(mode="after")
    def _policy_loss_params_are_accepted(self) -> "AlgorithmSettings":
        """As advantage_params: checked against the loss's signature, at load (which imports the loss's module)."""
        given = set(self.policy_loss_params) | ({"clip_ratio_c"} if self.clip_ratio_c is not None else set())
        if not given:
            return self
        if "clip_ratio_c" in self.policy_loss_params:
            raise ValueError("clip_ratio_c is a key of trainer.algorithm itself, not of policy_loss_params")
        unknown, accepted = _unaccepted(POLICY_LOSSES.get(self.policy_loss), given, POLICY_LOSS_INPUTS)
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: not a parameter of policy loss {self.policy_loss!r} (set in "
                f"{'trainer.algorithm' if unknown == ['clip_ratio_c'] else 'policy_loss_params'}); it takes "
                f"{', '.join(accepted) or 'none'}"
            )
        return self

    @model_validator(mode="after")
    def _correction_band(self) -> "AlgorithmSettings":
        if self.is_mask_low >= self.is_mask_high:
            raise ValueError(f"is_mask_low ({self.is_mask_low}) must be below is_mask_high ({self.is_mask_high}): "
                             "ratios outside [is_mask_low, is_mask_high] are masked")
        return self

    @model_validator(mode="after")
    def _adaptive_kl_has_a_penalty(self) -> "AlgorithmSettings":
        if self.kl_ctrl == "adaptive" and self.kl_penalty_coef <= 0:
            raise ValueError("kl_ctrl: adaptive moves the KL reward penalty's coefficient, starting from "
                             "kl_penalty_coef, which is 0; set kl_penalty_coef (e.g. 0.001) or kl_ctrl: fixed")
        return self

    @property
    def uses_critic(self) -> bool:
        """A value model trains beside the policy and gives the advantage its values (PPO with a critic)."""
        return self.advantage == "gae"

    @property
    def advantage_kwargs(self) -> dict[str, Any]:
        """The keywords the advantage function is called with besides the batch's inputs."""
        gae = {"gamma": self.gae_gamma, "lam": self.gae_lambda} if self.uses_critic else {}
        gigpo = {"step_weight": self.gigpo_step_weight} if self.advantage == "gigpo" else {}
        return {**gae, **gigpo, **self.advantage_params}

    @property
    def policy_loss_kwargs(self) -> dict[str, Any]:
        """The keywords the policy loss is called with."""
        extra = {"clip_ratio_c": self.clip_ratio_c} if self.clip_ratio_c is not None else {}
        return {"clip_low": self.clip_low, "clip_high": self.clip_high, **extra, **self.policy_loss_params}

    @property
    def correction_kwargs(self) -> dict[str, Any]:
        """The keywords of :func:`streamrft.engines.algorithms.behaviour_weights` (bar ``rows``)."""
        return {"correction": self.is_correction, "cap": self.tis_cap, "low": self.is_mask_low,
                "high": self.is_mask_high}

    def chord_mu(self, step: int) -> float:
        """CHORD's SFT weight at optimiser step ``step`` (:func:`streamrft.engines.algorithms.chord.chord_mu`)."""
        from ..algorithms.chord import chord_mu

        return chord_mu(step, mu_peak=self.chord_mu_peak, mu_valley=self.chord_mu_valley,
                        mu_warmup_steps=self.chord_mu_warmup_steps, mu_decay_steps=self.chord_mu_decay_steps)

    @model_validator(mode="after")
    def _distillation_once(self) -> "AlgorithmSettings":
        if self.advantage == "distill" and self.distill_coef > 0:
            raise ValueError("advantage: distill is distillation alone, and distill_coef adds the same term to "
                             "another advantage (grpo, ...); set one of them")
        return self

    @property
    def greedy_baseline(self) -> bool:
        """Rollout workers generate a greedy sample beside each training group, ReMax's baseline."""
        return self.advantage == "remax"

    @property
    def uses_teacher(self) -> bool:
        """Training reads the teacher's logprobs of the experiences (on-policy distillation)."""
        return self.advantage == "distill" or self.distill_coef > 0

    @property
    def needs_reference(self) -> bool:
        """A reference model is loaded only when some KL term is on."""
        return self.kl_coef > 0 or self.kl_penalty_coef > 0


class TrainingSettings(OptimizerSettings, AlgorithmSettings):
    """Everything the training engine is configured by: both groups of knobs, and the sampling temperature."""

    temperature: float = Field(default=1.0, gt=0,
                               description="logits are divided by it, as the rollout engine did when sampling")

    @classmethod
    def of(cls, optimizer: OptimizerSettings, algorithm: AlgorithmSettings, temperature: float) -> "TrainingSettings":
        """Combine the two groups (or the config sections that extend them) with a temperature."""
        values = {name: getattr(optimizer, name) for name in OptimizerSettings.model_fields}
        values |= {name: getattr(algorithm, name) for name in AlgorithmSettings.model_fields}
        return cls(**values, temperature=temperature)
