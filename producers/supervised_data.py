"""Chat and preference files -> supervised experiences for the ``experiences`` topic (``streamrft data produce``).

Every row becomes one SFT experience, or a DPO pair of two, or a :class:`Rejected` with its line number and the
reason, exactly as task files do (the same readers: JSONL, JSON array, CSV, Parquet, stdin).

What the records hold (the trainer's contract, ``engines/training/supervised.py``):
- ``tokens``: the conversation through the model's chat template; ``prompt_length``: the tokens before the first
  trained one; ``action_mask``: 1 on the assistant's tokens (end-of-turn token included), 0 on other turns;
- ``objective`` SFT: ``group_id`` = ``<dataset>-<line>`` (or the row's ``--id-key``), a group of one;
  ``logprobs`` 0 (no behaviour policy to compare with);
- ``objective`` DPO: the pair is the group (``group_size`` 2, the same key, so one partition), ``run_index`` 0
  the chosen response and 1 the rejected; ``logprobs`` are the reference policy's (a :class:`Reference`,
  :class:`streamrft.engines.training.reference.ReferencePolicy` for ``streamrft data produce``);
- ``step`` 0, ``model_version`` 0, ``kind`` TRAIN: staleness does not apply to data.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from streamrft.schemas import Experience, Objective, RolloutKind, pack_f32, pack_i32, pack_u8

from .chat_rows import ChatMapping, Conversation, to_conversation, to_preference
from .chat_tokens import ChatTokens, tokenize_conversation
from .task_files import Rejected, read_rows

CHOSEN, REJECTED = 0, 1
PRODUCER_ID = "data-producer"


class Reference(Protocol):
    """The reference policy of DPO as the producer uses it: the model the training starts from, scoring each
    response once (the caller builds it: producers load no model themselves)."""

    name: str  # recorded in each side's info["reference"]
    batch_size: int  # sequences scored at once

    def logprobs(self, experiences: Sequence[Experience]) -> list[list[float]]:
        """Per experience, the reference logprob of each of its response tokens."""


def read_sft(source: str | Path, mapping: ChatMapping, tokenizer, *, max_tokens: int | None = None
             ) -> Iterator[Experience | Rejected]:
    """One SFT experience per row of ``source``, or the row's rejection."""
    for line, row in read_rows(source):
        yield sft_experience(line, row, mapping, tokenizer, max_tokens)


def read_dpo(source: str | Path, mapping: ChatMapping, tokenizer, reference: Reference, *,
             max_tokens: int | None = None) -> Iterator[list[Experience] | Rejected]:
    """One DPO pair ``[chosen, rejected]`` per row of ``source``, or the row's rejection. Pairs are scored by
    ``reference`` a batch at a time, so they come out in groups; rejections come out at once."""
    waiting: list[list[Experience]] = []
    for line, row in read_rows(source):
        pair = dpo_pair(line, row, mapping, tokenizer, max_tokens)
        if isinstance(pair, Rejected):
            yield pair
            continue
        waiting.append(pair)
        if 2 * len(waiting) >= reference.batch_size:
            yield from _scored(waiting, reference)
            waiting = []
    yield from _scored(waiting, reference)


def sft_experience(line: int, row: Any, mapping: ChatMapping, tokenizer, max_tokens: int | None = None
                   ) -> Experience | Rejected:
    if isinstance(row, Rejected):
        return row
    group_id = _group_id(line, row, mapping)
    if isinstance(group_id, Rejected):
        return group_id
    conversation = to_conversation(row, mapping)
    if isinstance(conversation, str):
        return Rejected(line, conversation, row)
    tokens = tokenize_conversation(tokenizer, conversation, max_tokens)
    if isinstance(tokens, str):
        return Rejected(line, tokens, row)
    return _experience(tokens, conversation, group_id, 0, 1, Objective.SFT, mapping, line)


def dpo_pair(line: int, row: Any, mapping: ChatMapping, tokenizer, max_tokens: int | None = None
             ) -> list[Experience] | Rejected:
    """The two sides of a row's pair, their ``logprobs`` still 0 (:func:`read_dpo` scores them)."""
    if isinstance(row, Rejected):
        return row
    group_id = _group_id(line, row, mapping)
    if isinstance(group_id, Rejected):
        return group_id
    preference = to_preference(row, mapping)
    if isinstance(preference, str):
        return Rejected(line, preference, row)
    sides = []
    for run_index, continuation, name in ((CHOSEN, preference.chosen, "chosen"),
                                          (REJECTED, preference.rejected, "rejected")):
        conversation = preference.side(continuation)
        tokens = tokenize_conversation(tokenizer, conversation, max_tokens)
        if isinstance(tokens, str):
            return Rejected(line, f"{name}: {tokens}", row)
        sides.append(_experience(tokens, conversation, group_id, run_index, 2, Objective.DPO, mapping, line))
    chosen, rejected = sides
    if chosen.tokens[: 4 * chosen.prompt_length] != rejected.tokens[: 4 * rejected.prompt_length]:
        return Rejected(line, "chosen and rejected tokenise with different prompts (the chat template writes the "
                              "prompt differently before each)", row)
    return sides


def _scored(pairs: list[list[Experience]], reference: Reference) -> Iterator[list[Experience]]:
    if not pairs:
        return
    sides = [side for pair in pairs for side in pair]
    for side, logprobs in zip(sides, reference.logprobs(sides)):
        side.logprobs = pack_f32(logprobs)
        side.info["reference"] = reference.name
    yield from pairs


def _group_id(line: int, row: Any, mapping: ChatMapping) -> str | Rejected:
    if mapping.id_key is None:
        return f"{mapping.dataset}-{line}"
    value = row.get(mapping.id_key) if isinstance(row, dict) else None
    if value in (None, ""):
        return Rejected(line, f"missing id field {mapping.id_key!r}", row)
    return str(value)


def _experience(tokens: ChatTokens, conversation: Conversation, group_id: str, run_index: int, group_size: int,
                objective: Objective, mapping: ChatMapping, line: int) -> Experience:
    messages = conversation.messages
    first = next(i for i in range(conversation.trained_from, len(messages)) if messages[i]["role"] == "assistant")
    prompt_text = messages[first - 1]["content"] if first else ""
    return Experience(
        eid=f"{group_id}/{run_index}", group_id=group_id, task_id=group_id, step=0, kind=RolloutKind.TRAIN,
        run_index=run_index, group_size=group_size, model_version=0, tokens=pack_i32(tokens.ids),
        prompt_length=tokens.prompt_length, logprobs=pack_f32([0.0] * len(tokens.response_ids)),
        action_mask=pack_u8(tokens.action_mask), reward=0.0, objective=objective,
        prompt_text=prompt_text, response_text="\n".join(m["content"] for m in messages[first:]),
        info={"dataset": mapping.dataset, "line": str(line)}, worker_id=PRODUCER_ID)
