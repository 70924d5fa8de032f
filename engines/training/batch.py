"""Collating experiences into one padded batch.

Layout: prompts are **left**-padded to the batch's longest prompt ``P`` and responses **right**-padded to its
longest response ``R``, so every response starts at column ``P`` and all per-response-token tensors are
``[B, R]`` (aligned with the records' ``logprobs`` / ``action_mask`` / ``token_rewards``). Position ids count
from each sequence's first real token, so padding changes no logit.

The logit at column ``P − 1 + t`` predicts response token ``t``.

A micro-batch may also carry its rows packed end to end in one row without padding (``packed``,
:mod:`.packing`); the model then runs on that, and every per-token tensor here keeps the ``[B, R]`` layout.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from streamrft.schemas import Experience, unpack_f32

from .packing import PackedRows
from .record_inputs import greedy_rewards, turn_tensors


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, P + R] long
    attention_mask: torch.Tensor  # [B, P + R] long
    position_ids: torch.Tensor  # [B, P + R] long
    prompt_lengths: torch.Tensor  # [B] long
    response_lengths: torch.Tensor  # [B] long
    response_mask: torch.Tensor  # [B, R] float: real response token AND action_mask
    behaviour_logprobs: torch.Tensor  # [B, R] float: the rollout policy's logprobs
    rewards: torch.Tensor  # [B] float
    token_rewards: torch.Tensor | None  # [B, R] float, or None when no record carries any
    model_versions: torch.Tensor  # [B] long
    needs_correction: torch.Tensor  # [B] bool: apply importance correction (stale experiences)
    truncated: torch.Tensor  # [B] bool: cut by a budget (max_tokens, an episode's turns or tokens)
    group_ids: list[Hashable]
    # a teacher's logprobs of the response tokens (on-policy distillation), [B, R] float, and which rows carry
    # them ([B] bool); None when no record carries any
    teacher_logprobs: torch.Tensor | None = None
    has_teacher: torch.Tensor | None = None
    # what the records carry for some advantage estimators (.record_inputs): the greedy sample's score ([B]
    # float, NaN where none; remax), each response token's model turn and that turn's state ([B, R] long; gigpo)
    greedy_rewards: torch.Tensor | None = None
    turn_index: torch.Tensor | None = None
    turn_state: torch.Tensor | None = None
    # filled by TrainingEngine.prepare
    old_logprobs: torch.Tensor | None = None  # the proximal policy's: the weights' before the optimiser step
    # prepared for one update: old_logprobs (and the IS weights of reweighted_rows, [B] bool) come from the
    # training forward itself (.proximal); backward fills them in
    proximal_in_pass: bool = False
    reweighted_rows: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None  # [B, R] truncated IS weights (1 when not corrected)
    # with a critic (advantage: gae, .critic): its values V(s_t) before its update, and its targets (λ-returns)
    values: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    metrics: dict[str, float] = field(default_factory=dict)
    # the rows laid end to end without padding, which the forward then runs on (a micro-batch's, .packing)
    packed: PackedRows | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.response_width

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def num_tokens(self) -> int:
        """Trained tokens in the batch."""
        return int(self.response_mask.sum().item())

    def to(self, device: torch.device | str) -> "Batch":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        on_device = replace(self, **moved, packed=None)
        return on_device.pack() if self.packed is not None else on_device

    def select(self, rows: Sequence[int] | slice) -> "Batch":
        """The given rows, re-trimmed to their own longest prompt and response (fewer padded columns)."""
        index = torch.arange(len(self))[rows]
        if index.numel() == 0:
            raise ValueError("cannot select an empty batch")
        p_new = int(self.prompt_lengths[index].max())
        r_new = int(self.response_lengths[index].max())
        p_old = self.prompt_width
        seq_cols = slice(p_old - p_new, p_old + r_new)
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "metrics":
                values[f.name] = dict(value)
            elif f.name == "packed":  # packed rows are a micro-batch's own: pack the selection again
                values[f.name] = None
            elif f.name == "group_ids":
                values[f.name] = [value[i] for i in index.tolist()]
            elif value is None or isinstance(value, bool):
                values[f.name] = value
            elif f.name in ("input_ids", "attention_mask", "position_ids"):
                values[f.name] = value[index.to(value.device)][:, seq_cols]
            elif value.dim() == 2:  # per response token
                values[f.name] = value[index.to(value.device)][:, :r_new]
            else:
                values[f.name] = value[index.to(value.device)]
        return Batch(**values)

    def pack(self) -> "Batch":
        """These rows with their sequences laid end to end for the forward (:class:`.packing.PackedRows`)."""
        return replace(self, packed=PackedRows.of(self.input_ids, self.attention_mask, self.position_ids,
                                                  self.prompt_lengths, self.response_lengths))

    def micro_batches(self, size: int) -> Iterator["Batch"]:
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))


def _response_array(exp: Experience, values: np.ndarray, what: str) -> np.ndarray:
    if len(values) != exp.response_length:
        raise ValueError(
            f"experience {exp.eid}: {what} has {len(values)} entries but the response has "
            f"{exp.response_length} tokens ({len(exp.tokens) // 4} tokens, prompt_length={exp.prompt_length})"
        )
    return values


def collate(
    experiences: Sequence[Experience],
    *,
    pad_token_id: int = 0,
    needs_correction: Sequence[bool] | None = None,
) -> Batch:
    """Pad ``experiences`` into a :class:`Batch` (see the module docstring for the layout).

    ``needs_correction`` marks experiences for importance correction (from
    :func:`streamrft.engines.algorithms.apply_staleness`). Raises ValueError naming the experience when its
    logprobs, action mask or token rewards do not have one entry per response token.
    """
    if not experiences:
        raise ValueError("cannot collate an empty list of experiences")
    if needs_correction is not None and len(needs_correction) != len(experiences):
        raise ValueError(f"{len(needs_correction)} correction flags for {len(experiences)} experiences")
    n = len(experiences)
    prompt_lens = [e.prompt_length for e in experiences]
    resp_lens = [e.response_length for e in experiences]
    for e, r in zip(experiences, resp_lens):
        if e.prompt_length < 1 or r < 0:
            raise ValueError(f"experience {e.eid}: prompt_length={e.prompt_length} with {len(e.tokens) // 4} tokens")
    p, r = max(prompt_lens), max(resp_lens)

    input_ids = np.full((n, p + r), pad_token_id, dtype=np.int64)
    attention = np.zeros((n, p + r), dtype=np.int64)
    response_mask = np.zeros((n, r), dtype=np.float32)
    behaviour = np.zeros((n, r), dtype=np.float32)
    token_rewards = np.zeros((n, r), dtype=np.float32)
    any_token_rewards = False
    teacher = np.zeros((n, r), dtype=np.float32)
    has_teacher = np.zeros(n, dtype=bool)
    for i, e in enumerate(experiences):
        tokens = e.token_array
        pl, rl = prompt_lens[i], resp_lens[i]
        input_ids[i, p - pl : p + rl] = tokens
        attention[i, p - pl : p + rl] = 1
        response_mask[i, :rl] = _response_array(e, e.action_mask_array, "action_mask")
        behaviour[i, :rl] = _response_array(e, e.logprob_array, "logprobs")
        tr = e.token_reward_array
        if tr is not None:
            token_rewards[i, :rl] = _response_array(e, tr, "token_rewards")
            any_token_rewards = True
        if e.teacher_logprobs is not None:
            teacher[i, :rl] = _response_array(e, unpack_f32(e.teacher_logprobs), "teacher_logprobs")
            has_teacher[i] = True
    turns = turn_tensors(experiences, r)
    attention_t = torch.from_numpy(attention)
    positions = (attention_t.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=attention_t,
        position_ids=positions,
        prompt_lengths=torch.tensor(prompt_lens, dtype=torch.long),
        response_lengths=torch.tensor(resp_lens, dtype=torch.long),
        response_mask=torch.from_numpy(response_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        rewards=torch.tensor([e.reward for e in experiences], dtype=torch.float32),
        token_rewards=torch.from_numpy(token_rewards) if any_token_rewards else None,
        model_versions=torch.tensor([e.model_version for e in experiences], dtype=torch.long),
        needs_correction=torch.tensor(
            list(needs_correction) if needs_correction is not None else [False] * n, dtype=torch.bool
        ),
        truncated=torch.tensor([e.truncated for e in experiences], dtype=torch.bool),
        group_ids=[e.group_id for e in experiences],
        teacher_logprobs=torch.from_numpy(teacher) if has_teacher.any() else None,
        has_teacher=torch.from_numpy(has_teacher) if has_teacher.any() else None,
        greedy_rewards=greedy_rewards(experiences),
        turn_index=None if turns is None else turns[0],
        turn_state=None if turns is None else turns[1],
    )
