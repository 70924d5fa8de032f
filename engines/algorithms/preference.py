"""Preference losses: learning from pairs of responses to one prompt, one preferred (*chosen*), one not
(*rejected*). They compare the policy with a frozen reference policy (the policy the training started from).

Common signature::

    fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta) -> PreferenceLossOutput

all ``[P]``, one entry per pair: the log-probability of each side's whole response (the sum over its trained
tokens) under the policy (with gradient) and under the reference (no gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceLossOutput:
    loss: torch.Tensor  # [P] per pair, to be averaged over the step's pairs
    chosen_rewards: torch.Tensor  # [P] the implicit reward β·(logπ − logπ_ref) of the chosen side (detached)
    rejected_rewards: torch.Tensor  # [P] the same for the rejected side (detached)


def dpo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLossOutput:
    """DPO (Rafailov et al. 2023), the sigmoid loss:

    ``L = −log σ(β·[(logπ(y_c) − logπ_ref(y_c)) − (logπ(y_r) − logπ_ref(y_r))])`` per pair.

    ``β·(logπ − logπ_ref)`` is each side's implicit reward; their difference is the reward margin, and a pair
    counts as ranked right when it is positive. At the start (policy = reference) every margin is 0 and the
    loss is log 2. ``logsigmoid`` keeps a large negative margin finite.
    """
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards)
    return PreferenceLossOutput(loss, chosen_rewards.detach(), rejected_rewards.detach())


def ipo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLossOutput:
    """IPO (Azar et al. 2023): a squared loss that pulls the log-ratio margin to a target instead of pushing it
    without bound (DPO can drive a pair whose preference is certain to infinity):

    ``h = (logπ(y_c) − logπ_ref(y_c)) − (logπ(y_r) − logπ_ref(y_r))``, ``L = (h − 1/(2β))²`` per pair.

    Log-probabilities are sums over the response's tokens, as for ``dpo`` (TRL's IPO averages them per token).
    The implicit rewards reported are DPO's, ``β·(logπ − logπ_ref)``.
    """
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
    margin = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    loss = (margin - 1 / (2 * beta)) ** 2
    return PreferenceLossOutput(loss, chosen_rewards.detach(), rejected_rewards.detach())
