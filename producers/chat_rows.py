"""Rows of chat and preference files, as the common formats write them, into conversations (no tokenizer here).

SFT rows (``--as sft``), either
- ``{"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}``: every assistant turn is
  trained, and the conversation ends with one; or
- ``{"prompt": ..., "completion": ...}`` (TRL's prompt-completion format): the prompt is text (one user turn) or
  messages, the completion text (one assistant turn) or messages.

DPO rows (``--as dpo``): ``{"prompt": ..., "chosen": ..., "rejected": ...}``, each text or messages, as above; or,
without a prompt, ``chosen`` and ``rejected`` as whole conversations (the Anthropic HH layout), whose common
first messages are the prompt.

A row that is none of these becomes the sentence that says why (and how to fix it), never an exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Message = dict[str, str]


@dataclass(frozen=True)
class ChatMapping:
    """Which fields of a row hold what, and the dataset name the experiences' ids start with."""

    dataset: str = "data"
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    id_key: str | None = None  # None: ids are <dataset>-<line>

    @classmethod
    def from_data_file(cls, data_file) -> "ChatMapping":
        """The mapping a config ``DataFile`` describes."""
        from pathlib import Path

        return cls(dataset=data_file.dataset or Path(data_file.path).stem, messages_key=data_file.messages_key,
                   prompt_key=data_file.prompt_key, completion_key=data_file.completion_key,
                   chosen_key=data_file.chosen_key, rejected_key=data_file.rejected_key)


@dataclass(frozen=True)
class Conversation:
    """An SFT example: its messages; the assistant turns from ``messages[trained_from]`` on are trained."""

    messages: list[Message]
    trained_from: int = 0


@dataclass(frozen=True)
class Preference:
    """A DPO example: one prompt, a chosen and a rejected continuation (each ending with an assistant turn)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]

    def side(self, continuation: list[Message]) -> Conversation:
        return Conversation(self.prompt + continuation, trained_from=len(self.prompt))


def to_conversation(row: Any, mapping: ChatMapping) -> Conversation | str:
    """An SFT row's conversation, or why the row is not one."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, expected an object with {mapping.messages_key!r}"
    if mapping.messages_key in row:
        messages = _messages(row[mapping.messages_key], mapping.messages_key)
        if isinstance(messages, str):
            return messages
        problem = _ends_with_the_assistant(messages, mapping.messages_key)
        return problem or Conversation(messages)
    if mapping.prompt_key in row and mapping.completion_key in row:
        prompt = _turns(row[mapping.prompt_key], mapping.prompt_key, "user")
        completion = _turns(row[mapping.completion_key], mapping.completion_key, "assistant")
        for part in (prompt, completion):
            if isinstance(part, str):
                return part
        problem = _ends_with_the_assistant(completion, mapping.completion_key)
        return problem or Conversation(prompt + completion, trained_from=len(prompt))
    return (f"no {mapping.messages_key!r} and no {mapping.prompt_key!r} + {mapping.completion_key!r} (set "
            "--messages-key, or --prompt-key and --completion-key, to the fields that hold them)")


def to_preference(row: Any, mapping: ChatMapping) -> Preference | str:
    """A DPO row's prompt and two continuations, or why the row is not a preference pair."""
    if not isinstance(row, dict):
        return (f"row is a {type(row).__name__}, expected an object with {mapping.chosen_key!r} and "
                f"{mapping.rejected_key!r}")
    missing = [key for key in (mapping.chosen_key, mapping.rejected_key) if key not in row]
    if missing:
        return f"missing {' and '.join(map(repr, missing))} (set --chosen-key / --rejected-key)"
    if mapping.prompt_key in row:
        prompt = _turns(row[mapping.prompt_key], mapping.prompt_key, "user")
        chosen = _turns(row[mapping.chosen_key], mapping.chosen_key, "assistant")
        rejected = _turns(row[mapping.rejected_key], mapping.rejected_key, "assistant")
        for part in (prompt, chosen, rejected):
            if isinstance(part, str):
                return part
    else:
        split = _split_conversations(row[mapping.chosen_key], row[mapping.rejected_key], mapping)
        if isinstance(split, str):
            return split
        prompt, chosen, rejected = split
    for part, key in ((chosen, mapping.chosen_key), (rejected, mapping.rejected_key)):
        problem = _ends_with_the_assistant(part, key)
        if problem:
            return problem
    if chosen == rejected:
        return "chosen and rejected are the same response: the pair teaches nothing"
    return Preference(prompt, chosen, rejected)


def _split_conversations(chosen: Any, rejected: Any, mapping: ChatMapping):
    """Two whole conversations -> (their common first messages, the rest of each), or why not."""
    chosen = _messages(chosen, mapping.chosen_key)
    rejected = _messages(rejected, mapping.rejected_key)
    for part in (chosen, rejected):
        if isinstance(part, str):
            return part
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    if common == 0:
        return (f"no {mapping.prompt_key!r}, and {mapping.chosen_key!r} and {mapping.rejected_key!r} share no first "
                "message to be the prompt (add a prompt field, or give both the same opening turns)")
    return chosen[:common], chosen[common:], rejected[common:]


def _turns(value: Any, key: str, role: str) -> list[Message] | str:
    """Text as one turn of ``role``, or messages as they are."""
    if isinstance(value, str):
        if not value.strip():
            return f"{key!r} is empty"
        return [{"role": role, "content": value}]
    return _messages(value, key)


def _messages(value: Any, key: str) -> list[Message] | str:
    if not isinstance(value, list) or not value:
        return f"{key!r} must be a non-empty list of messages ({{'role': ..., 'content': ...}}), not {_kind(value)}"
    messages = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            return f"{key!r} message {number} has no 'role'"
        content = message.get("content")
        if not isinstance(content, str):
            return (f"{key!r} message {number} ({message['role']}) has content of type {_kind(content)}; give its "
                    "text as a string")
        if message["role"] == "assistant" and not content.strip():
            return f"{key!r} message {number} is an empty assistant turn"
        messages.append({"role": message["role"], "content": content})
    return messages


def _ends_with_the_assistant(messages: list[Message], key: str) -> str | None:
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "nothing"
        return f"{key!r} ends with {last!r}; it must end with the assistant's turn, which is what is trained"
    return None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
