"""Loss aggregation: how a per-token loss matrix ``[B, R]`` becomes one scalar.

Common signature::

    fn(values [B, R], mask [B, R], *, num_tokens=None, num_seqs=None) -> scalar

``num_tokens`` / ``num_seqs`` are the normalisers of the *whole* optimiser step. When a step is split into
micro-batches, passing the full batch's counts makes the micro-batch losses sum to exactly the full-batch loss,
so gradient accumulation is equivalent to one big batch. Left as None they are taken from ``mask``.
"""
from __future__ import annotations

import torch


def token_mean(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None) -> torch.Tensor:
    """``Σ_{i,t} m_it·x_it / Σ_{i,t} m_it`` — every trained token weighs the same (DAPO's choice)."""
    denom = mask.sum() if num_tokens is None else num_tokens
    return (values * mask).sum() / max(float(denom), 1.0)


def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None) -> torch.Tensor:
    """``(1/B) Σ_i Σ_t m_it·x_it`` — sum over each sequence's tokens, mean over sequences (Dr. GRPO-like)."""
    denom = values.shape[0] if num_seqs is None else num_seqs
    return (values * mask).sum() / max(float(denom), 1.0)


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, *, num_tokens=None, num_seqs=None) -> torch.Tensor:
    """``(1/B) Σ_i (Σ_t m_it·x_it / Σ_t m_it)`` — mean per sequence, then mean over sequences (original GRPO)."""
    denom = values.shape[0] if num_seqs is None else num_seqs
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(float(denom), 1.0)
