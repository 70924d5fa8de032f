"""What the records carry for the advantage estimators beyond rewards (:mod:`streamrft.schemas.experience_extras`),
as the batch's tensors, and handed to the estimators that declare them (``remax``: ``greedy_rewards``; ``gigpo``,
``step_grpo``: ``turn_index``, ``turn_state``)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from streamrft.schemas import Experience
from streamrft.schemas.experience_extras import GREEDY_REWARD, TURN_STATES, decode_turn_states, state_key


class Carrying(Protocol):
    """What :func:`record_inputs` reads of a batch (a :class:`~.batch.Batch`)."""

    greedy_rewards: torch.Tensor | None
    turn_index: torch.Tensor | None
    turn_state: torch.Tensor | None


def greedy_rewards(experiences: Sequence[Experience]) -> torch.Tensor | None:
    """``[B]``: each record's ``metrics["greedy_reward"]``, NaN where it has none; None when none has one."""
    values = [e.metrics.get(GREEDY_REWARD, float("nan")) for e in experiences]
    if all(np.isnan(values)):
        return None
    return torch.tensor(values, dtype=torch.float32)


def turn_tensors(experiences: Sequence[Experience], width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(turn_index, turn_state)``, each ``[B, width]`` long, from the records' ``info["turn_states"]``: per
    response token, its turn's number in the episode (−1 before the first turn and on padding) and a number per
    distinct state (the same state key, the same number). A record without turns is one turn taken in its
    prompt's state. None when no record has turns. ValueError naming the record whose turns are malformed."""
    if not any(TURN_STATES in e.info for e in experiences):
        return None
    index = np.full((len(experiences), width), -1, dtype=np.int64)
    state = np.full((len(experiences), width), -1, dtype=np.int64)
    numbers: dict[str, int] = {}
    for row, e in enumerate(experiences):
        length = e.response_length
        if TURN_STATES in e.info:
            try:
                turns = decode_turn_states(e.info[TURN_STATES], length)
            except ValueError as exc:
                raise ValueError(f"experience {e.eid}: {exc}") from exc
        else:
            turns = [(0, state_key(e.token_array[:e.prompt_length].astype("<i4").tobytes()))]
        ends = [start for start, _ in turns[1:]] + [length]
        for number, ((start, key), end) in enumerate(zip(turns, ends)):
            index[row, start:end] = number
            state[row, start:end] = numbers.setdefault(key, len(numbers))
    return torch.from_numpy(index), torch.from_numpy(state)


def record_inputs(advantage_fn: Callable, batch: Carrying) -> dict[str, torch.Tensor]:
    """The inputs above that ``advantage_fn`` declares, when the batch has them (an estimator gets none it
    cannot fall back without: its parameters default to None)."""
    declared = inspect.signature(advantage_fn).parameters
    available = {"greedy_rewards": batch.greedy_rewards, "turn_index": batch.turn_index,
                 "turn_state": batch.turn_state}
    return {name: value for name, value in available.items() if name in declared and value is not None}
