"""A conversation -> token ids with the model's chat template, and a mask that is 1 on the assistant's tokens.

The whole conversation is rendered once and tokenised once (tokenising turn by turn can merge tokens
differently at the seams, and the model is trained on what the template writes). Each trained assistant turn is
located as a span of characters: it begins where the template, asked for the conversation up to that turn with
the generation prompt, stops (``<|im_start|>assistant\\n`` is the prompt's, not the model's) and ends where the
conversation up to and including the turn ends, cut after the end-of-turn token (the model must learn to stop;
the newline a template writes after it is never generated). A token is trained when it starts inside a span: the
fast tokenizer's offsets map tokens to characters.

A template that does not write a conversation's shorter versions as prefixes of the whole (some drop earlier
reasoning, or stamp a date) leaves no such spans; those rows are rejected with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from .chat_rows import Conversation


@dataclass(frozen=True)
class ChatTokens:
    ids: list[int]
    prompt_length: int  # tokens before the first trained token
    action_mask: list[int]  # per response token (ids[prompt_length:]): 1 = an assistant token, trained

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_length:]


def tokenize_conversation(tokenizer, conversation: Conversation, max_tokens: int | None = None) -> ChatTokens | str:
    """``conversation`` as the model sees it, with its assistant turns (from ``trained_from`` on) masked in; or
    why it cannot be (a sentence). ``tokenizer``: a fast Hugging Face tokenizer with a chat template."""
    messages = conversation.messages
    full = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for index in range(conversation.trained_from, len(messages)):
        if messages[index]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], generation_prompt=True) if index else ""
        through = _render(tokenizer, messages[: index + 1], generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            return (f"the chat template does not write this conversation's turns as prefixes of the whole (turn "
                    f"{index + 1}), so its assistant tokens cannot be located; use a template that does (ChatML does)")
        spans.append((len(before), _end_of_turn(through, len(before), tokenizer.eos_token)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if max_tokens is not None and len(ids) > max_tokens:
        return f"{len(ids)} tokens; at most {max_tokens} fit (the model's positions, or --max-tokens)"
    trained = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]]
    if not any(trained):
        return "no assistant token to train on after the chat template (an empty or missing assistant turn)"
    prompt_length = trained.index(1)
    if prompt_length == 0:
        return "the conversation starts with a trained token; it needs a prompt before the first assistant turn"
    return ChatTokens(ids, prompt_length, trained[prompt_length:])


def _render(tokenizer, messages, *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _end_of_turn(through: str, start: int, eos_text: str | None) -> int:
    """Where an assistant turn that begins at ``start`` of ``through`` ends: after its end-of-turn token when the
    template writes one, else after its last character that is not whitespace."""
    if eos_text:
        found = through.rfind(eos_text, start)
        if found >= 0:
            return found + len(eos_text)
    return len(through.rstrip())
