"""What serve mode's answers look like, in OpenAI's two dialects: a chat completion (``/v1/chat/completions``)
and a text completion (``/v1/completions``), whole or as stream chunks, with their logprobs.

Token texts: a response token's text is what it adds to the decoded response (so the texts add up to the
answer's text); a prompt token's (``echo``) and an alternative's is the token decoded alone. Alternatives come
from the engine (``Completion.top_logprobs``: the most likely tokens and the sampled one); a chat answer lists
the ``top_logprobs`` most likely, a text completion the engine's set, as vLLM's server does (OpenAI's lists the
``logprobs`` most likely, which the sampled token is among when it is the most likely: lm-eval's greedy check).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from streamrft.engines.inference import Completion

from .api_models import ChatRequest, CompletionRequest
from .chat_prompt import ToolAnswer

Decode = Callable[[list[int]], str]


def finish_reason(completion: Completion) -> str:
    return "length" if completion.truncated else "stop"


def _alternatives(top: dict[int, float] | None, decode: Decode, count: int | None) -> list[tuple[str, float]]:
    """(text, logprob) of the alternatives at one position, most likely first (the ``count`` most likely)."""
    ranked = sorted((top or {}).items(), key=lambda item: -item[1])
    return [(decode([token]), logprob) for token, logprob in ranked[:count]]


class ChatFormat:
    """A chat completion's choices, whole or as chunks; with ``tools``, an answer that calls one is given as
    ``tool_calls`` (``chat_prompt.ToolAnswer``)."""

    endpoint, object, chunk_object = "chat", "chat.completion", "chat.completion.chunk"

    def __init__(self, request: ChatRequest, decode: Decode, tools: ToolAnswer | None = None) -> None:
        self.request = request
        self.decode = decode
        self.tools = tools
        self._started: set[int] = set()  # choices whose first chunk (with the role) went out

    def logprobs(self, texts: list[str], logprobs: Sequence[float],
                 tops: Sequence[dict[int, float]] | None = None) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        count = self.request.top_logprobs or 0
        content = []
        for i, (text, logprob) in enumerate(zip(texts, logprobs)):
            top = _alternatives(tops[i], self.decode, count) if count and tops else []
            content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]})
        return {"content": content}

    def choice(self, index: int, completion: Completion, texts: list[str]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        finish = finish_reason(completion)
        calls = self.tools.calls(completion.text) if self.tools is not None else None
        if calls is not None:
            message = {"role": "assistant", "content": calls.content, "tool_calls": calls.tool_calls}
            finish = "tool_calls"
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": self.logprobs(texts, completion.logprobs, completion.top_logprobs)}

    def chunk_choice(self, index: int, text: str, texts: list[str], logprobs: list[float],
                     finish: str | None) -> dict[str, Any] | None:
        if not text and finish is None and index in self._started and not self.request.logprobs:
            return None  # its text is held back (a partial character, a possible stop string)
        delta: dict[str, Any] = {"content": text} if text or finish is None else {}
        if index not in self._started:
            self._started.add(index)
            delta = {"role": "assistant", **delta, "content": text}
        return {"index": index, "delta": delta, "finish_reason": finish,
                "logprobs": self.logprobs(texts, logprobs) if texts else None}

    def whole_chunk_choice(self, index: int, completion: Completion, texts: list[str]) -> dict[str, Any]:
        """A choice streamed as one chunk once it is done (an answer that may be a tool call)."""
        whole = self.choice(index, completion, texts)
        return {"index": index, "delta": whole["message"], "finish_reason": whole["finish_reason"],
                "logprobs": whole["logprobs"]}


class TextFormat:
    """A text completion's choices, whole or as chunks; with ``echo``, the prompt (and its logprobs: None for
    its first token, as OpenAI's) before each choice's text."""

    endpoint, object, chunk_object = "completions", "text_completion", "text_completion"

    def __init__(self, request: CompletionRequest, decode: Decode, prompt_texts: list[str]) -> None:
        self.request = request
        self.decode = decode
        self.prompt_texts = prompt_texts  # each prompt as the client gave it (text) or decoded (token ids)

    def logprobs(self, texts: list[str], logprobs: Sequence[float | None],
                 tops: Sequence[dict[int, float] | None] | None = None) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        alternatives = [None if tops is None or top is None else dict(_alternatives(top, self.decode, None))
                        for top in (tops if tops is not None else [None] * len(texts))]
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": alternatives,
                "text_offset": offsets}

    def choice(self, index: int, completion: Completion, texts: list[str]) -> dict[str, Any]:
        text, logprobs, tops = completion.text, list(completion.logprobs), completion.top_logprobs
        if tops is None:  # an engine without alternatives: the sampled token's own
            tops = [{t: lp} for t, lp in zip(completion.response_ids, completion.logprobs)]
        if self.request.echo:
            prompt = completion.prompt_logprobs or [None] * len(completion.prompt_ids)
            own = [None if step is None else step.get(token) for token, step in zip(completion.prompt_ids, prompt)]
            texts = [self.decode([t]) for t in completion.prompt_ids] + texts
            text = self.prompt_texts[index // self.request.n] + text
            logprobs, tops = own + logprobs, list(prompt) + list(tops)
        return {"index": index, "text": text, "logprobs": self.logprobs(texts, logprobs, tops),
                "finish_reason": finish_reason(completion)}

    def chunk_choice(self, index: int, text: str, texts: list[str], logprobs: list[float],
                     finish: str | None) -> dict[str, Any] | None:
        if not text and finish is None and self.request.logprobs is None:
            return None
        return {"index": index, "text": text, "finish_reason": finish,
                "logprobs": self.logprobs(texts, logprobs) if texts else None}


Format = ChatFormat | TextFormat
