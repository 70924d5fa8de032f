"""What an Experience's open maps carry for the trainer's advantage estimators, beyond its reward. The record's
schema does not change: ``metrics`` and ``info`` are maps, and these keys are conventions of them, written by
the rollout workers and read by the trainer (a writer in another language writes the same strings):

- ``metrics["greedy_reward"]``: the score (reward plus its turns' rewards) of the task's greedy sample:
  temperature 0, generated with the group and never trained on. ReMax's baseline (``advantage: remax``); absent
  when the writer generated none. Finite.
- ``info["turn_states"]``: the model turns of a multi-turn episode and the environment state each was taken in,
  ``"<start>:<state>,<start>:<state>,..."``: ``start`` is the response index of the turn's first token (strictly
  ascending, inside the response), ``state`` a key of letters and digits, equal for equal states (GiGPO's anchor
  states, ``advantage: gigpo``). A turn runs from its start to the next turn's.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

GREEDY_REWARD = "greedy_reward"
TURN_STATES = "turn_states"


def state_key(state: str | bytes) -> str:
    """A short key of ``state`` that is the same in every process (16 hex digits of BLAKE2b)."""
    data = state.encode() if isinstance(state, str) else state
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def encode_turn_states(turns: Sequence[tuple[int, str]]) -> str:
    """``[(start, state), ...]`` as ``info["turn_states"]``."""
    return ",".join(f"{start}:{state}" for start, state in turns)


def decode_turn_states(text: str, response_length: int) -> list[tuple[int, str]]:
    """``info["turn_states"]`` back as ``[(start, state), ...]``; ValueError saying what is wrong."""
    turns: list[tuple[int, str]] = []
    for entry in text.split(",") if text else []:
        start, sep, state = entry.partition(":")
        if not sep or not start.isdigit() or not state.isalnum():
            raise ValueError(f"info[{TURN_STATES!r}] entry {entry[:40]!r} is not <start>:<state> (a response "
                             "index and a key of letters and digits)")
        index = int(start)
        if index >= response_length or (turns and index <= turns[-1][0]):
            raise ValueError(f"info[{TURN_STATES!r}] starts must ascend inside the response of {response_length} "
                             f"tokens, got {index} after {turns[-1][0] if turns else 'none'}")
        turns.append((index, state))
    return turns


def check_extras(metrics: Mapping[str, float], info: Mapping[str, str], response_length: int) -> None:
    """ValueError when a key above is present but malformed."""
    greedy = metrics.get(GREEDY_REWARD)
    if greedy is not None and not math.isfinite(greedy):
        raise ValueError(f"metrics[{GREEDY_REWARD!r}] is {greedy}, not a finite reward")
    if TURN_STATES in info:
        decode_turn_states(info[TURN_STATES], response_length)
