"""Supervised rows in a training step: SFT conversations and DPO pairs (``Experience.objective``), trained beside
RL rows in one optimiser step. No Kafka, no config.

**Weighting.** Each objective's loss is averaged over its own rows: SFT over its trained tokens (token mean), DPO
over its pairs, RL by the configured aggregation. The step's loss is their sum, each weighted by the objective's
share of the batch's rows: ``L = Σ_o (n_o / n) · L_o``. So a 10 % SFT share of the rows is a 10 % share of the
loss, and a batch of one objective trains exactly as that objective alone. With ``mix_weighting: chord`` the RL
and SFT losses are weighed ``1 − μ`` and ``μ`` instead, μ on CHORD's schedule over the steps
(:func:`~streamrft.engines.algorithms.chord.chord_weights`), the RL loss so even in a step without SFT rows.

**Only RL rows reach the RL machinery** (advantages, old logprobs, KL, staleness, importance weights): an SFT row
in a GRPO group would move its baseline, and a supervised row has no behaviour policy to correct for.

**SFT:** ``L = −(1/T) Σ_t m_t · log π(y_t)``, the negative log-likelihood of the T assistant tokens
(``action_mask``) of the step's SFT rows: the ``sft`` policy loss, token-mean aggregated (``sft_loss: sft_phi``:
CHORD-φ's token weights).

**DPO:** a pair is a group of two records, ``run_index`` 0 the chosen response and 1 the rejected, with the same
prompt. Their ``logprobs`` are the reference policy's: ``streamrft data produce --as dpo`` computed them with the
initial model, so the trainer keeps no reference model and runs no reference forward. Each side's
log-probability is the sum over its trained tokens, and the loss is ``trainer.algorithm.preference_loss`` (DPO's
sigmoid by default) with ``dpo_beta``. The loss couples a pair's two sides, so DPO micro-batches hold whole pairs
and ranks split pairs, never a pair.

Both supervised objectives score at temperature 1: the sampling temperature shapes rollouts, not the likelihood
of data.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from streamrft.schemas import Experience, Objective

from ..algorithms import POLICY_LOSSES, PREFERENCE_LOSSES, token_mean
from ..algorithms.chord import chord_weights
from ..settings.training import TrainingSettings
from .batch import Batch
from .logprobs import response_logprobs
from .micro_batches import MicroBatch, MicroBatching, split
from .parallel import SingleProcess


class StepEngine(Protocol):
    """What a mixed step uses of the training engine (:class:`~.engine.TrainingEngine`): its stages, its
    data-parallel strategy and its model."""

    settings: TrainingSettings
    parallel: SingleProcess
    model: torch.nn.Module
    train_model: torch.nn.Module  # the model as wrapped for training (DDP / FSDP)
    autocast_dtype: torch.dtype | None
    critic: Any  # .critic.Critic | None: trains on the RL rows first, with advantage gae

    @property
    def step(self) -> int: ...  # optimiser steps taken: CHORD's schedule runs on it

    def prepare(self, experiences: Any, needs_correction: Any = None, *, one_update: bool = False) -> Batch: ...

    def collate(self, experiences: Sequence[Experience]) -> Batch: ...

    def backward(self, batch: Batch, weight: float = 1.0) -> dict[str, float]: ...

    def begin_accumulation(self) -> None: ...

    def apply_gradients(self) -> dict[str, float]: ...

CHOSEN, REJECTED = 0, 1  # a DPO record's run_index


@dataclass
class ObjectiveSplit:
    """A step's experiences by objective; ``dpo`` in pair order (chosen, rejected, chosen, rejected, ...)."""

    rl: list[Experience] = field(default_factory=list)
    rl_flags: list[bool] = field(default_factory=list)  # needs_correction of the RL rows
    sft: list[Experience] = field(default_factory=list)
    dpo: list[Experience] = field(default_factory=list)

    @classmethod
    def of(cls, experiences: Sequence[Experience], needs_correction: Sequence[bool] | None = None) -> "ObjectiveSplit":
        flags = list(needs_correction) if needs_correction is not None else [False] * len(experiences)
        split = cls()
        dpo = []
        for exp, flag in zip(experiences, flags, strict=True):
            if exp.objective == Objective.SFT:
                split.sft.append(exp)
            elif exp.objective == Objective.DPO:
                dpo.append(exp)
            else:
                split.rl.append(exp)
                split.rl_flags.append(flag)
        split.dpo = pair_order(dpo)
        return split

    @property
    def rows(self) -> int:
        return len(self.rl) + len(self.sft) + len(self.dpo)

    @property
    def only_rl(self) -> bool:
        return not self.sft and not self.dpo

    def share(self, rows: Sequence[Experience]) -> float:
        return len(rows) / self.rows


def pair_problem(sides: Sequence[Experience]) -> str | None:
    """Why the records of one DPO group are not a preference pair, or None: two records, one chosen
    (run_index 0) and one rejected (1), with the same prompt tokens."""
    if len(sides) != 2:
        return f"a DPO pair has 2 records, this group has {len(sides)}"
    if sorted(side.run_index for side in sides) != [CHOSEN, REJECTED]:
        return (f"a DPO pair is run_index 0 (chosen) and 1 (rejected), this group has "
                f"{sorted(side.run_index for side in sides)}")
    first, second = sides
    if first.prompt_length != second.prompt_length or (first.token_array[: first.prompt_length].tolist()
                                                       != second.token_array[: second.prompt_length].tolist()):
        return "the chosen and the rejected response follow different prompts"
    return None


def pair_order(experiences: Sequence[Experience]) -> list[Experience]:
    """DPO records as ``[chosen, rejected, chosen, rejected, ...]``, pairs in first-seen order; ValueError naming
    the group when its records are not a pair (the trainer dead-letters those before they reach a step)."""
    groups: dict[str, list[Experience]] = defaultdict(list)
    for exp in experiences:
        groups[exp.group_id].append(exp)
    ordered = []
    for group_id, sides in groups.items():
        problem = pair_problem(sides)
        if problem is not None:
            raise ValueError(f"DPO group {group_id!r}: {problem}")
        ordered += sorted(sides, key=lambda side: side.run_index)
    return ordered


def train_mixed_step(engine: StepEngine, split: ObjectiveSplit) -> dict[str, float]:
    """One optimiser step on RL and supervised rows together (module docstring: each objective's loss weighted
    by its share of the rows)."""
    metrics: dict[str, float] = {}
    shares = split.share(split.rl), split.share(split.sft), split.share(split.dpo)
    if engine.settings.mix_weighting == "chord":
        mu = engine.settings.chord_mu(engine.step)
        rl_weight, sft_weight, dpo_weight = chord_weights(mu, *shares)
        metrics["mix/chord_mu"] = mu
    else:
        rl_weight, sft_weight, dpo_weight = shares
    if split.rl:
        batch = engine.prepare(split.rl, split.rl_flags, one_update=True)
        metrics.update(batch.metrics)
        if engine.critic is not None:
            metrics.update(engine.critic.update(batch))
        metrics.update(engine.backward(batch, weight=rl_weight))
    if split.sft:
        metrics.update(sft_backward(engine, engine.collate(split.sft), weight=sft_weight))
    if split.dpo:
        metrics.update(dpo_backward(engine, engine.collate(split.dpo), weight=dpo_weight))
    metrics.update(engine.apply_gradients())
    metrics.update({"mix/rl_share": shares[0], "mix/sft_share": shares[1], "mix/dpo_share": shares[2],
                    "mix/rl_weight": rl_weight, "mix/sft_weight": sft_weight})
    return metrics


def sft_backward(engine: StepEngine, batch: Batch, weight: float = 1.0) -> dict[str, float]:
    """Accumulate ``weight`` × the SFT loss of ``batch``'s rows (token mean over all of them, whatever the
    micro-batches and ranks); returns ``sft/*`` metrics."""
    engine.begin_accumulation()
    nll = POLICY_LOSSES.get(engine.settings.sft_loss)
    num_tokens = float(batch.response_mask.sum())
    total = 0.0
    micro_batches = list(engine.parallel.micro_batches(batch, MicroBatching.of(engine.settings)))
    engine.model.train()
    for k, micro in enumerate(micro_batches):
        with engine.parallel.gradient_sync(engine.train_model, last=k == len(micro_batches) - 1):
            mb = micro.batch
            logp = _logprobs(engine, mb)
            zeros = torch.zeros_like(logp)
            loss = token_mean(nll(logp, logp.detach(), zeros, mb.response_mask).token_loss, mb.response_mask,
                              num_tokens=num_tokens)
            (loss * weight * engine.parallel.loss_scale).backward()
        total += float(loss.detach())
    (total,) = engine.parallel.sum([total])
    return {"sft/loss": total, "sft/num_tokens": num_tokens, "sft/num_sequences": float(len(batch))}


def dpo_backward(engine: StepEngine, batch: Batch, weight: float = 1.0) -> dict[str, float]:
    """Accumulate ``weight`` × the preference loss of ``batch``, whose rows are pairs in order (chosen,
    rejected, ...) and whose behaviour logprobs are the reference's (mean over the pairs); ``dpo/*`` metrics."""
    engine.begin_accumulation()
    s = engine.settings
    loss_fn = PREFERENCE_LOSSES.get(s.preference_loss)
    num_pairs = len(batch) // 2
    sums = dict.fromkeys(("loss", "margin", "correct", "chosen", "rejected"), 0.0)
    micro_batches = list(pair_micro_batches(engine.parallel, batch, MicroBatching.of(s)))
    engine.model.train()
    for k, micro in enumerate(micro_batches):
        with engine.parallel.gradient_sync(engine.train_model, last=k == len(micro_batches) - 1):
            mb = micro.batch
            logp = _logprobs(engine, mb)
            if micro.padding:  # keeps this rank's collectives in step with the others; trains nothing
                loss = (logp * 0.0).sum()
            else:
                mask = mb.response_mask
                policy = (logp * mask).sum(-1)
                reference = (mb.behaviour_logprobs * mask).sum(-1)
                out = loss_fn(policy[CHOSEN::2], policy[REJECTED::2], reference[CHOSEN::2], reference[REJECTED::2],
                              beta=s.dpo_beta)
                loss = out.loss.sum() / num_pairs
                margins = out.chosen_rewards - out.rejected_rewards
                sums["margin"] += float(margins.sum())
                sums["correct"] += float((margins > 0).sum())
                sums["chosen"] += float(out.chosen_rewards.sum())
                sums["rejected"] += float(out.rejected_rewards.sum())
            (loss * weight * engine.parallel.loss_scale).backward()
        sums["loss"] += float(loss.detach())
    sums = dict(zip(sums, engine.parallel.sum(list(sums.values()))))
    return {
        "dpo/loss": sums["loss"],
        "dpo/reward_margin": sums["margin"] / num_pairs,
        "dpo/accuracy": sums["correct"] / num_pairs,
        "dpo/chosen_reward": sums["chosen"] / num_pairs,
        "dpo/rejected_reward": sums["rejected"] / num_pairs,
        "dpo/num_pairs": float(num_pairs),
        "dpo/num_tokens": float(batch.response_mask.sum()),
    }


def pair_micro_batches(parallel: SingleProcess, batch: Batch, size: MicroBatching | int) -> Iterator[MicroBatch]:
    """This rank's share of ``batch``'s pairs (rows 2i, 2i + 1) in micro-batches of ``size`` rows rounded down
    to whole pairs (at least one), or as a :class:`MicroBatching` says (a token budget, packing), shortest pairs
    first, the same number on every rank (as ``SingleProcess.micro_batches`` does for rows)."""
    return split(batch, size, parallel, unit=2)


def _logprobs(engine: StepEngine, mb: Batch) -> torch.Tensor:
    logp, _ = response_logprobs(engine.train_model, mb, temperature=1.0, autocast_dtype=engine.autocast_dtype)
    return logp
