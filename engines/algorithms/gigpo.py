"""GiGPO: group-in-group policy optimisation for multi-turn episodes (Feng et al. 2025, "Group-in-Group Policy
Optimization for LLM Agent Training", arXiv:2505.10978). Beside the episode-level group of GRPO, the model turns
of a group's episodes that were taken in the same environment state (an *anchor state*) form a step-level group,
and each turn is credited relative to the other actions taken in that state.

What the estimators read, per response token (the trainer's collate builds both from each experience's
``info["turn_states"]``, :mod:`streamrft.schemas.experience_extras`): ``turn_index``, the number of the model
turn the token belongs to in its episode (−1: none), and ``turn_state``, a number naming that turn's state
(equal numbers, equal states). Without them every row is one turn, all rows of a group in one state (their
shared prompt): a single-turn task.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .advantages import group_index, group_stats, sequence_scores


def _relative(values: torch.Tensor, groups: Sequence[Hashable], normalize: bool, epsilon: float) -> torch.Tensor:
    """``(v − mean_G v) / (std_G v + ε)`` (or ``v − mean_G v`` without ``normalize``) within each group ``G``;
    0 in a group of one."""
    mean, std, count = group_stats(values, groups)
    centred = values - mean
    relative = centred / (std + epsilon) if normalize else centred
    return torch.where(count > 1, relative, torch.zeros_like(values))


def turn_returns(rewards: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None,
                 turn_index: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per episode and turn ``[B, T]``: the discounted return ``R_t = Σ_{k ≥ t} γ^(k−t) r_k`` and whether the
    turn exists. ``r_k`` is what turn ``k`` earned: the token rewards on its trained tokens, plus the episode's
    outcome ``rewards_i`` on its last turn (so ``Σ_k r_k`` is the episode's score, as ``grpo`` counts it)."""
    m = mask.to(torch.float32)
    on_turn = turn_index >= 0
    index = turn_index.clamp(min=0)
    n_turns = int(turn_index.max()) + 1 if bool(on_turn.any()) else 1
    rows = rewards.shape[0]
    earned = torch.zeros(rows, n_turns, device=m.device)
    if token_rewards is not None:
        earned.scatter_add_(1, index, token_rewards.to(torch.float32) * m * on_turn)
    # tokens of no turn are scattered onto turn 0 with nothing to add: a sum, never an overwrite
    present = torch.zeros(rows, n_turns, dtype=torch.long, device=m.device).scatter_add_(1, index, on_turn.long()) > 0
    last = torch.where(present, torch.arange(n_turns, device=m.device), -1).amax(1)
    has_turn = last >= 0
    earned[has_turn, last[has_turn]] += rewards.to(torch.float32)[has_turn]
    returns = torch.zeros_like(earned)
    running = torch.zeros(rows, device=m.device)
    for t in reversed(range(n_turns)):
        running = earned[:, t] + gamma * running
        returns[:, t] = running
    return returns * present, present


def step_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[Hashable],
                    token_rewards: torch.Tensor | None, turn_index: torch.Tensor | None,
                    turn_state: torch.Tensor | None, *, gamma: float, normalize: bool,
                    epsilon: float) -> torch.Tensor:
    """GiGPO's step-level relative advantage ``A^S`` per token ``[B, R]`` (§4.2): the turns of a group's
    episodes are grouped by state, ``G^S(s̃) = {(a_t^i, R_t^i) | s_t^i = s̃}``, and each turn gets
    ``A^S(a_t^i) = (R_t^i − mean_{G^S} R) / F_norm(G^S)`` on its tokens, ``F_norm`` the group's std (``normalize``)
    or 1. A turn alone in its state gets 0."""
    m = mask.to(torch.float32)
    if turn_index is None or turn_state is None:  # one turn per row, the prompt its state
        turn_index = torch.where(m > 0, 0, -1)
        turn_state = torch.zeros_like(turn_index)
    turn_index, turn_state = turn_index.to(m.device).long(), turn_state.to(m.device).long()
    returns, present = turn_returns(rewards, mask, token_rewards, turn_index, gamma)
    index = turn_index.clamp(min=0)
    state = torch.full_like(returns, -1, dtype=torch.long).scatter_reduce(
        1, index, torch.where(turn_index >= 0, turn_state, -1), reduce="amax")  # a turn's tokens share its state
    episode, _ = group_index(group_ids, m.device)
    rows, turns = present.nonzero(as_tuple=True)
    anchors = list(zip(episode[rows].tolist(), state[rows, turns].tolist()))
    relative = torch.zeros_like(returns)
    if anchors:
        relative[rows, turns] = _relative(returns[rows, turns], anchors, normalize, epsilon)
    return relative.gather(1, index) * (turn_index >= 0) * m


def gigpo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    turn_index: torch.Tensor | None = None,
    turn_state: torch.Tensor | None = None,
    step_weight: float = 1.0,
    gamma: float = 0.95,
    normalize: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GiGPO: ``A(a_t^i) = A^E(τ_i) + ω·A^S(a_t^i)`` (§4, the two levels combined; ω = ``step_weight``, from
    ``trainer.algorithm.gigpo_step_weight``), on every trained token of turn ``t`` of episode ``i``:

    * ``A^E(τ_i) = (R(τ_i) − mean_g R) / F_norm(g)`` (§4.1), the episode-level group ``g`` being the task's
      episodes and ``R(τ_i)`` the episode's score (reward plus turn rewards): ``grpo``;
    * ``A^S`` the step-level advantage of :func:`step_advantages` (§4.2), with discount ``gamma`` (γ; the
      paper's 0.95 by default) inside the returns ``R_t``;
    * ``F_norm`` the unbiased std of the group (+ ε), or 1 with ``normalize: false`` (the paper's variant
      without the std, against the bias of a group whose rewards barely differ).

    Tokens of no turn (none when the episode records its turns) get ``A^E`` alone."""
    if step_weight < 0 or not 0 <= gamma <= 1:
        raise ValueError(f"gigpo needs step_weight >= 0 and gamma in [0, 1], got {step_weight}, {gamma}")
    scores = sequence_scores(rewards, mask, token_rewards)
    episode = _relative(scores, group_ids, normalize, epsilon)[:, None] * mask.to(torch.float32)
    if step_weight == 0:
        return episode
    return episode + step_weight * step_advantages(rewards, mask, group_ids, token_rewards, turn_index, turn_state,
                                                   gamma=gamma, normalize=normalize, epsilon=epsilon)


def step_grpo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    token_rewards: torch.Tensor | None = None,
    turn_index: torch.Tensor | None = None,
    turn_state: torch.Tensor | None = None,
    gamma: float = 0.95,
    normalize: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Step-wise GRPO: GiGPO's step-level advantage alone, ``A(a_t^i) = A^S(a_t^i)`` (§4.2): GRPO over the
    turns taken in the same state, on each turn's discounted return. A turn alone in its state (a state no
    other episode of the group reached) gets 0, so this learns only where episodes meet; ``gigpo`` adds the
    episode-level term for the rest."""
    if not 0 <= gamma <= 1:
        raise ValueError(f"step_grpo needs gamma in [0, 1], got {gamma}")
    return step_advantages(rewards, mask, group_ids, token_rewards, turn_index, turn_state, gamma=gamma,
                           normalize=normalize, epsilon=epsilon)
