"""A step's rows in micro-batches: one forward/backward each, the gradients accumulating over them.

A micro-batch holds ``trainer.micro_batch_size`` rows, or, with ``trainer.max_tokens_per_micro_batch``, as many
rows as fit that many tokens of forward: for padded rows their count × (longest prompt + longest response), for
packed rows (``trainer.pack_sequences``, :mod:`.packing`) the sum of their lengths. Sampled answers vary in
length, often by tens of times; a row count sized for the longest leaves the short ones' micro-batches small,
and one sized for the short ones runs out of memory on a long tail. A budget in tokens holds the work (and the
activation memory) of every micro-batch near the same size. A sequence longer than the budget runs alone in its
micro-batch (and is logged): the budget bounds the others, and no data is refused for its length.

How rows are split changes no loss and no gradient: every micro-batch's loss is normalised by the whole step's
counts (:mod:`.loss`, the ``loss_agg`` functions' ``num_tokens`` / ``num_seqs``), so the micro-batches add up to
the loss of one pass over the step, whatever the split; only float sums run in another order.

Rows go shortest first, so a micro-batch, trimmed to its own longest prompt and response (``Batch.select``),
carries little padding. Under data parallelism each rank splits its own share of the rows, and every rank must
run the same number of micro-batches (FSDP all-gathers parameters in each forward): every rank holds the whole
batch, so each computes all ranks' splits, and one that has fewer runs padding micro-batches (one row, nothing
trained: zero mask, zero advantage) whose gradient is zero.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from .batch import Batch

logger = logging.getLogger(__name__)


class Ranks(Protocol):
    """What the split needs of a data-parallel strategy (:mod:`.parallel`)."""

    rank: int
    world_size: int

    def rows(self, n: int, rank: int | None = None) -> range: ...


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch of this rank's rows; ``rows`` are the rows of ``batch`` it holds, in its order. A padding
    micro-batch (``padding=True``, no rows) trains nothing and only keeps the ranks' collectives in step."""

    rows: list[int]
    batch: Batch
    padding: bool = False


def padding_row(batch: Batch) -> Batch:
    """One row of ``batch`` that trains nothing (zero mask and advantages): a rank's micro-batch when it has run
    out of rows, so that it still enters every collective the other ranks do."""
    row = batch.select([0])
    zeros = torch.zeros_like(row.response_mask)
    return replace(row, response_mask=zeros, advantages=None if row.advantages is None else zeros.clone())


@dataclass(frozen=True)
class MicroBatching:
    """How rows are grouped into micro-batches: ``rows`` at a time, or up to ``max_tokens`` tokens of forward;
    ``pack``: each micro-batch's sequences laid end to end in one row (:mod:`.packing`)."""

    rows: int = 8
    max_tokens: int | None = None
    pack: bool = False

    @classmethod
    def of(cls, settings: Any) -> "MicroBatching":
        """From the trainer's settings (:class:`~streamrft.engines.settings.training.OptimizerSettings`)."""
        return cls(settings.micro_batch_size, settings.max_tokens_per_micro_batch, settings.pack_sequences)

    def cost(self, prompt_lengths: list[int], response_lengths: list[int]) -> int:
        """Tokens a forward of these rows runs on: their lengths' sum when packed, else the padded rectangle."""
        if self.pack:
            return sum(prompt_lengths) + sum(response_lengths)
        return len(prompt_lengths) * (max(prompt_lengths) + max(response_lengths))

    def group(self, units: list[list[int]], prompt_lengths: list[int], response_lengths: list[int]) -> list[list[int]]:
        """``units`` (lists of rows kept together: a row, or a DPO pair), shortest first, grouped into micro-batches
        of rows."""
        if self.max_tokens is None:
            per = max(1, self.rows // max(1, len(units[0]) if units else 1))
            return [[row for unit in units[k:k + per] for row in unit] for k in range(0, len(units), per)]
        groups: list[list[int]] = []
        current: list[int] = []
        for unit in units:
            candidate = current + unit
            if current and self.cost([prompt_lengths[i] for i in candidate],
                                     [response_lengths[i] for i in candidate]) > self.max_tokens:
                groups.append(current)
                candidate = list(unit)
            current = candidate
        if current:
            groups.append(current)
        return groups

    def take(self, batch: Batch, rows: list[int]) -> Batch:
        """The micro-batch of ``batch``'s ``rows`` as its forward takes it (trimmed; packed when ``pack``)."""
        chosen = batch.select(rows)
        return chosen.pack() if self.pack else chosen


def split(batch: Batch, how: MicroBatching | int, ranks: Ranks, unit: int = 1) -> Iterator[MicroBatch]:
    """This rank's share of ``batch`` in micro-batches, the same number on every rank (module docstring).

    ``how``: a :class:`MicroBatching`, or a row count. ``unit``: rows that stay together, ``unit`` consecutive
    rows at a time (2: DPO's chosen and rejected side of a pair); ranks share whole units.
    """
    how = how if isinstance(how, MicroBatching) else MicroBatching(rows=how)
    prompt, response = batch.prompt_lengths.tolist(), batch.response_lengths.tolist()
    num_units = len(batch) // unit
    plans = []
    for rank in range(ranks.world_size):
        mine = ranks.rows(num_units, rank)
        units = [list(range(u * unit, (u + 1) * unit)) for u in mine]
        units.sort(key=lambda rows: max(prompt[i] + response[i] for i in rows))  # stable: ties keep their order
        plans.append(how.group(units, prompt, response))
    count = max(len(plan) for plan in plans)
    mine = plans[ranks.rank]
    if how.max_tokens is not None:
        _warn_over_budget(mine, how, prompt, response)
    for k in range(count):
        if k < len(mine):
            yield MicroBatch(mine[k], how.take(batch, mine[k]))
        else:
            padding = padding_row(batch)
            yield MicroBatch([], padding.pack() if how.pack else padding, padding=True)


def _warn_over_budget(groups: list[list[int]], how: MicroBatching, prompt: list[int], response: list[int]) -> None:
    """Log the micro-batches whose rows alone are over the token budget (each such unit runs alone)."""
    over = {tuple(rows): cost for rows in groups
            if (cost := how.cost([prompt[i] for i in rows], [response[i] for i in rows])) > how.max_tokens}
    if over:
        longest = max(over, key=over.get)
        logger.warning("%d micro-batch(es) over trainer.max_tokens_per_micro_batch (%d), each of rows that run "
                       "alone, the longest rows %s with %d tokens; raise the budget if that runs out of memory",
                       len(over), how.max_tokens, list(longest), over[longest])
