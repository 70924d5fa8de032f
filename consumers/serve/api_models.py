"""The OpenAI-style bodies serve mode's HTTP API reads: chat and text completion requests, and feedback."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class BaseRequest(BaseModel):
    """What both completion requests share."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server does not use

    model: str = ""
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    # serve.grouping conversation: which conversation the request belongs to (the openai client sends it with
    # extra_body={"conversation_id": ...})
    conversation_id: str | None = Field(default=None, min_length=1, max_length=200)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False


class CompletionRequest(BaseRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0)


class Feedback(BaseModel):
    response_id: str = Field(min_length=1)
    choice: int = Field(default=0, ge=0)
    reward: float
    group_id: str | None = None
    group_size: int | None = Field(default=None, ge=1)
    end_conversation: bool = False  # serve.grouping conversation: write the conversation's responses now
