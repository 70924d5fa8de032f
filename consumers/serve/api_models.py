"""The OpenAI-style bodies serve mode's HTTP API reads: chat and text completion requests, and feedback.

Every field has a type (strict: ``"0.5"`` is no number, ``1`` no string), a range (numbers finite and bounded,
strings and lists a length, ids a pattern), so a value that passes reaches the engine or a topic as something it
can use. What depends on the server (``serve.max_n``, the model's context and vocabulary) is checked in
``app.py`` against the same field names. ``errors.py`` turns a refusal into an answer that names the field and
what it allows, read from these models' JSON schema.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

ID_PATTERN = r"^[A-Za-z0-9._:@-]+$"  # ids end up in record keys and group ids (``/`` separates a feedback key)
MAX_ID_CHARS = 200
MAX_TEXT_CHARS = 1 << 18  # one message or prompt; serve.max_body_bytes and serve.max_prompt_tokens bound it too
MAX_TOKENS = 1 << 20  # any token count; the model's context bounds it further (app.py)
MAX_N = 1024  # choices; serve.max_n bounds it further (app.py)
MAX_SEED = 1 << 62  # the engines seed choice j with seed + j, in a 64-bit generator seed
MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32; the vocabulary bounds them further (app.py)
MAX_REWARD = 1e6  # finite, and far from float32's limit where advantages and losses are computed

_STRICT = ConfigDict(extra="ignore", strict=True)  # OpenAI clients send fields this server does not use

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class BaseRequest(BaseModel):
    """What both completion requests share."""

    model_config = _STRICT

    model: str = Field(default="", max_length=MAX_ID_CHARS)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    n: int = Field(default=1, ge=1, le=MAX_N)
    # serve.grouping conversation: which conversation the request belongs to (the openai client sends it with
    # extra_body={"conversation_id": ...})
    conversation_id: Id | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None  # OpenAI's limit: 4

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class Message(BaseModel):
    model_config = _STRICT
    # the roles chat templates know; any other string would be written into the prompt as a role of its own
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_TEXT_CHARS)


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False


class CompletionRequest(BaseRequest):
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)] | Annotated[
        list[TokenId], Field(min_length=1, max_length=MAX_TOKENS)]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's limit


class Feedback(BaseModel):
    model_config = ConfigDict(strict=True)

    response_id: str = Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)
    choice: int = Field(default=0, ge=0, le=MAX_N - 1)
    reward: float = Field(ge=-MAX_REWARD, le=MAX_REWARD, allow_inf_nan=False)
    group_id: Id | None = None
    group_size: int | None = Field(default=None, ge=1, le=MAX_N)
    end_conversation: bool = False  # serve.grouping conversation: write the conversation's responses now


# what each route reads (the error answers and the generated test follow it)
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest, "/feedback": Feedback}
