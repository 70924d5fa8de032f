"""What ``TrainingEngine.prepare`` computes once the old and reference logprobs are known: the KL reward penalty,
the advantages (a teacher's beside them when distilling: :mod:`.distillation`), the masking of truncated samples,
and the batch's own metrics."""
from __future__ import annotations

import torch

from ..algorithms import distill, kl_penalty
from ..algorithms.catalog import ADVANTAGES, KL_ESTIMATORS
from ..algorithms.gae import gae_returns
from ..algorithms.kl_control import KlController
from ..settings.training import TrainingSettings
from .batch import Batch
from .distillation import distill_metrics, keep_rows_with_teacher, teacher_inputs
from .record_inputs import record_inputs


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def fill_advantages(batch: Batch, settings: TrainingSettings,
                    kl_ctrl: KlController | None = None) -> dict[str, float]:
    """Set ``batch.advantages`` (and narrow ``batch.response_mask`` to what is trained: rows a teacher did not
    score when distilling, truncated samples with ``mask_truncated``); the metrics of what it did. The KL reward
    penalty's coefficient is ``kl_ctrl``'s (``settings.kl_penalty_coef`` without one), which this batch's KL
    then updates."""
    s, mask, metrics = settings, batch.response_mask, {}
    token_rewards = batch.token_rewards
    if s.kl_penalty_coef > 0:
        coef = kl_ctrl.coef if kl_ctrl is not None else s.kl_penalty_coef
        token_rewards = kl_penalty(token_rewards, batch.old_logprobs, batch.ref_logprobs, mask,
                                   kl_coef=coef, estimator=s.kl_penalty_estimator)
        kl = KL_ESTIMATORS.get(s.kl_penalty_estimator)(batch.old_logprobs, batch.ref_logprobs)
        metrics["actor/kl_penalty"] = masked_mean(kl, mask)
        metrics["actor/kl_coef"] = coef
        if kl_ctrl is not None:
            kl_ctrl.update(metrics["actor/kl_penalty"], n_steps=len(batch))
    if s.uses_teacher:  # on-policy distillation: rows without the teacher's logprobs stay out of the loss
        metrics["distill/rows_without_teacher"] = float(keep_rows_with_teacher(batch))
        mask = batch.response_mask
    advantage_fn = ADVANTAGES.get(s.advantage)
    critic_inputs = {"values": batch.values} if s.uses_critic else {}
    batch.advantages = advantage_fn(batch.rewards, mask, batch.group_ids, token_rewards=token_rewards,
                                    **teacher_inputs(advantage_fn, batch), **record_inputs(advantage_fn, batch),
                                    **critic_inputs,
                                    **s.advantage_kwargs).to(mask.dtype)
    if s.uses_critic:  # the critic's targets, from the same rewards and values (.critic)
        batch.returns = gae_returns(batch.rewards, mask, token_rewards, batch.values, gamma=s.gae_gamma,
                                    lam=s.gae_lambda)
    if s.distill_coef > 0:  # distillation beside the task reward
        batch.advantages = batch.advantages + s.distill_coef * distill(
            batch.rewards, mask, batch.group_ids, **teacher_inputs(distill, batch)).to(mask.dtype)
    metrics.update(distill_metrics(batch, mask))
    if s.mask_truncated:  # after the advantages: a truncated sample still counts in its group's baseline
        metrics["actor/num_masked_truncated"] = float(batch.truncated.sum())
        mask = batch.response_mask = mask * (~batch.truncated).to(mask.dtype)[:, None]
        batch.advantages = batch.advantages * mask
    return metrics


def batch_metrics(batch: Batch, corrected: torch.Tensor) -> dict[str, float]:
    """Rewards, advantages and sizes of a prepared batch (``corrected``: the rows given IS weights)."""
    mask = batch.response_mask
    lengths = batch.response_lengths.to(torch.float32)
    return {
        "actor/reward_mean": float(batch.rewards.mean()),
        "actor/reward_std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
        "actor/advantage_mean": masked_mean(batch.advantages, mask),
        "actor/advantage_abs_mean": masked_mean(batch.advantages.abs(), mask),
        "actor/response_length_mean": float(lengths.mean()),
        "actor/num_sequences": float(len(batch)),
        "actor/num_tokens": float(mask.sum()),
        "actor/num_corrected": float(corrected.sum()),
    }
