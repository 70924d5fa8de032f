"""CHORD: supervised and RL losses in one step, weighted by a schedule ``μ`` over the steps, and an SFT term that
weighs each expert token by ``p·(1 − p)`` (Zhang et al. 2025, "On-Policy RL Meets Off-Policy Experts:
Harmonizing SFT and RL via Dynamic Weighting", arXiv:2508.11408). The schedule and the weights are plain
arithmetic (no torch: the settings call them); CHORD-φ's SFT term is the ``sft_phi`` policy loss
(:mod:`.policy_losses`)."""
from __future__ import annotations

import math


def chord_mu(step: int, *, mu_peak: float, mu_valley: float, mu_warmup_steps: int, mu_decay_steps: int) -> float:
    """CHORD-μ's schedule of the SFT weight at optimiser step ``step`` (0-based): a linear warm-up from 0 to
    ``mu_peak`` over ``mu_warmup_steps``, a cosine decay to ``mu_valley`` over ``mu_decay_steps``, then
    ``mu_valley``; the step's loss is ``L = (1 − μ)·L_RL + μ·L_SFT``."""
    if step < mu_warmup_steps:
        return mu_peak * step / mu_warmup_steps
    decayed = step - mu_warmup_steps
    if decayed >= mu_decay_steps:
        return mu_valley
    return mu_valley + (mu_peak - mu_valley) * 0.5 * (1.0 + math.cos(math.pi * decayed / mu_decay_steps))


def chord_weights(mu: float, rl_share: float, sft_share: float, dpo_share: float) -> tuple[float, float, float]:
    """The (RL, SFT, DPO) weights of a mixed step's losses under CHORD: DPO rows keep their share of the rows and
    the rest of the step is split ``(1 − μ) : μ`` between the RL and the SFT loss. A step without SFT rows (the
    SFT reader had none to give) still weighs its RL loss ``1 − μ``: the SFT term of ``(1 − μ)·L_RL + μ·L_SFT`` is
    missing, the RL one is not rescaled. A step without RL rows keeps the row shares."""
    if rl_share == 0:
        return rl_share, sft_share, dpo_share
    rest = 1.0 - dpo_share
    return rest * (1.0 - mu), rest * mu if sft_share > 0 else 0.0, dpo_share
