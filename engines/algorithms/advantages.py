"""Advantage estimators. Each one maps rewards to a per-token advantage matrix ``[B, R]`` (zero where ``mask`` is 0).

Common signature::

    fn(rewards [B], mask [B, R], group_ids (B hashables), *, token_rewards [B, R] | None = None, **params) -> [B, R]

* ``rewards`` — the scalar outcome reward of each experience.
* ``mask`` — 1 for response tokens that are trained on (padding and non-action tokens are 0).
* ``group_ids`` — experiences with the same id were sampled from the same prompt (a GRPO group).
* ``token_rewards`` — optional dense rewards per response token (the record's ``token_rewards`` and/or a KL
  penalty, see :func:`streamrft.engines.algorithms.kl.kl_penalty`).

Sequence-level estimators (``grpo``, ``dr_grpo``, ``rloo``) score an experience as
``score_i = rewards_i + Σ_t mask_it · token_rewards_it`` and broadcast its advantage to every trained token: for a
multi-turn episode, every model turn gets the episode's advantage (environment tokens have mask 0).
``grpo_reward_to_go`` credits each turn with the rewards from that turn on instead (turn-level credit).
A group with a single member has no baseline and gets advantage 0.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def sequence_scores(rewards: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None) -> torch.Tensor:
    """``rewards_i + Σ_t mask_it · token_rewards_it`` (just ``rewards`` without dense rewards)."""
    scores = rewards.to(torch.float32)
    if token_rewards is not None:
        scores = scores + (token_rewards.to(torch.float32) * mask).sum(-1)
    return scores


def group_index(group_ids: Sequence[Hashable], device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Dense group numbers in first-seen order: ``["b", "a", "b"] -> ([0, 1, 0], 2)``."""
    numbers: dict[Hashable, int] = {}
    index = [numbers.setdefault(g, len(numbers)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(numbers)


def group_stats(scores: torch.Tensor, group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per experience: its group's mean, unbiased standard deviation (0 for a singleton) and size."""
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {scores.shape[0]} rewards")
    index, n_groups = group_index(group_ids, scores.device)
    count = torch.zeros(n_groups, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    total = torch.zeros(n_groups, device=scores.device).index_add_(0, index, scores)
    mean = total / count
    centred = scores - mean[index]
    sq = torch.zeros(n_groups, device=scores.device).index_add_(0, index, centred * centred)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[index], std[index], count[index]


def _broadcast(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return advantages[:, None] * mask.to(torch.float32)


def grpo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): ``A_i = (s_i − mean_g(s)) / (std_g(s) + ε)``.

    ``std_g`` is the unbiased standard deviation of the scores in the group. A group whose scores are all equal
    gives 0 everywhere (no learning signal); singletons give 0.
    """
    scores = sequence_scores(rewards, mask, token_rewards)
    mean, std, count = group_stats(scores, group_ids)
    adv = torch.where(count > 1, (scores - mean) / (std + epsilon), torch.zeros_like(scores))
    return _broadcast(adv, mask)


def grpo_reward_to_go(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO with turn-level credit, for multi-turn episodes with per-turn rewards:
    ``A_it = (G_it − mean_g(s)) / (std_g(s) + ε)`` on trained tokens, where
    ``G_it = rewards_i + Σ_{t' ≥ t} mask_it' · token_rewards_it'`` is what episode ``i`` still collects from token
    ``t`` on (a turn's reward sits on its last token, so each token of a turn counts that turn), and
    ``s_i = rewards_i + Σ_t mask_it · token_rewards_it`` is the episode's score, whose group mean and std are the
    baseline, as in ``grpo``.

    So a turn is credited with its own reward and those after it, never with rewards earned before it. Without
    token rewards ``G_it = s_i`` and this is ``grpo``; singletons give 0.
    """
    scores = sequence_scores(rewards, mask, token_rewards)
    mean, std, count = group_stats(scores, group_ids)
    m = mask.to(torch.float32)
    if token_rewards is None:
        to_go = scores[:, None].expand_as(m)
    else:
        collected_from = (token_rewards.to(torch.float32) * m).flip(-1).cumsum(-1).flip(-1)
        to_go = rewards.to(torch.float32)[:, None] + collected_from
    adv = (to_go - mean[:, None]) / (std[:, None] + epsilon)
    return torch.where((count > 1)[:, None], adv, torch.zeros_like(adv)) * m


def dr_grpo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "GRPO done right"): ``A_i = s_i − mean_g(s)`` — no division by the group std.

    (The paper's other half, not normalising the loss by response length, is the ``seq-mean-token-sum`` or a
    constant-normaliser aggregation, chosen separately.)
    """
    scores = sequence_scores(rewards, mask, token_rewards)
    mean, _, count = group_stats(scores, group_ids)
    adv = torch.where(count > 1, scores - mean, torch.zeros_like(scores))
    return _broadcast(adv, mask)


def rloo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``A_i = s_i − (1/(n−1)) Σ_{j≠i} s_j``.

    Equivalently ``n/(n−1) · (s_i − mean_g(s))`` for a group of size ``n``; singletons give 0.
    """
    scores = sequence_scores(rewards, mask, token_rewards)
    mean, _, count = group_stats(scores, group_ids)
    loo_mean = (mean * count - scores) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores - loo_mean, torch.zeros_like(scores))
    return _broadcast(adv, mask)


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """1 at the last position of each row where ``mask`` is 1 (all zeros for an empty row)."""
    m = mask.to(torch.float32)
    after = m.flip(-1).cumsum(-1).flip(-1)  # how many trained tokens remain from t to the end
    return ((after == 1) & (m == 1)).to(torch.float32)


def reinforce_plus_plus(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    group_baseline: bool = False,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted returns of token rewards, whitened over the whole batch.

    * per-token reward ``r_t = token_rewards_t`` plus the outcome reward on the last trained token
      (with ``group_baseline=True`` — "REINFORCE++-baseline" — the outcome reward minus its group mean);
    * return ``G_t = r_t + γ · G_{t'}`` where ``t'`` is the next trained token (untrained tokens, e.g.
      environment turns, are skipped: they neither add reward nor discount);
    * ``A_t = (G_t − mean(G)) / (std(G) + ε)`` with mean and unbiased std over all trained tokens of the batch.
    """
    m = mask.to(torch.float32)
    outcome = rewards.to(torch.float32)
    if group_baseline:
        mean, _, _ = group_stats(outcome, group_ids)
        outcome = outcome - mean
    r = last_token_mask(m) * outcome[:, None]
    if token_rewards is not None:
        r = r + token_rewards.to(torch.float32) * m
    returns = torch.zeros_like(r)
    running = torch.zeros_like(outcome)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
        returns[:, t] = running
    valid = returns[m > 0]
    if valid.numel() < 2:
        return torch.zeros_like(returns)
    return (returns - valid.mean()) / (valid.std() + epsilon) * m


def distill(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025, "On-Policy Distillation"): the
    per-token reverse KL to a teacher, as the advantage,

    ``A_t = m_t · (logp_teacher_t − logp_behav_t)``,

    on the student's own samples (``logp_behav``: the rollout policy's logprob of the token it sampled,
    ``logp_teacher``: the teacher's of the same token, teacher-forced). ``−A_t`` is the one-sample (k1) estimate
    of ``KL(π‖π_teacher)`` at that position, so the policy gradient with this advantage lowers the reverse KL
    token by token: a token the teacher finds likelier than the student did is pushed up, one it finds unlikely
    is pushed down. Each token is its own credit (discount 0: a token is not charged for the tokens after it),
    there is no baseline and no group (``repeat_times`` may be 1); ``rewards`` and ``token_rewards`` are not
    used (``trainer.algorithm.distill_coef`` adds this term to a task reward's advantage instead).
    """
    return (teacher_logprobs.to(torch.float32) - behaviour_logprobs.to(torch.float32)) * mask.to(torch.float32)
