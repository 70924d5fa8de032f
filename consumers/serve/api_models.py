"""The OpenAI-style bodies serve mode's HTTP API reads: chat and text completion requests, and feedback.

Every field has a type (strict: ``"0.5"`` is no number, ``1`` no string), a range (numbers finite and bounded,
strings and lists a length, ids a pattern), so a value that passes reaches the engine or a topic as something it
can use. What depends on the server (``serve.max_n``, the model's context and vocabulary) is checked in
``app.py`` against the same field names. ``errors.py`` turns a refusal into an answer that names the field and
what it allows, read from these models' JSON schema.

A field OpenAI's API defines and this server does not is no field here: the body is refused with 400 naming it
(``extra="forbid"``), never answered as if it had been honoured. Fields that change nothing about the answer
(``user``, ``metadata``, ``store``, ``parallel_tool_calls``) are accepted and not used. Those that would change
how the server samples are fields with OpenAI's ranges, and ``app.py`` refuses what the engine cannot do (a
penalty, a logit bias, guided decoding without the vLLM engine) with 400 saying why.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ID_PATTERN = r"^[A-Za-z0-9._:@-]+$"  # ids end up in record keys and group ids (``/`` separates a feedback key)
MAX_ID_CHARS = 200
MAX_TEXT_CHARS = 1 << 18  # one message or prompt; serve.max_body_bytes and serve.max_prompt_tokens bound it too
MAX_TOKENS = 1 << 20  # any token count; the model's context bounds it further (app.py)
MAX_N = 1024  # choices; serve.max_n bounds it further (app.py)
MAX_SEED = 1 << 62  # the engines seed choice j with seed + j, in a 64-bit generator seed
INT64 = (-(1 << 63), (1 << 63) - 1)  # OpenAI's seed: any int64
MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32; the vocabulary bounds them further (app.py)
MAX_REWARD = 1e6  # finite, and far from float32's limit where advantages and losses are computed
MAX_PROMPTS = 64  # prompts of one /v1/completions request (a batch); serve.max_n bounds prompts x n further
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions' logprobs: 5
MAX_NAME_CHARS = 64  # a function's name, OpenAI's limit

_STRICT = ConfigDict(extra="forbid", strict=True)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# any int64 a client sends, folded into the engines' range [0, 2^62): the same seed always samples the same
Seed = Annotated[int, Field(ge=INT64[0], le=INT64[1]), AfterValidator(lambda seed: seed % MAX_SEED)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKENS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_.-]+$")]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
# OpenAI's logit_bias: token id (as a JSON key) -> a bias in [-100, 100]
LogitBias = Annotated[dict[Annotated[str, Field(max_length=12, pattern=r"^[0-9]+$")],
                           Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]], Field(max_length=300)]

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
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None  # OpenAI's limit: 4
    # sampling the engine does not do (its logprobs must be the policy's): in range, then refused unless neutral
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    # accepted, and nothing about the answer depends on them
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(BaseModel):
    """A part of a message's content. Only ``text`` parts are read (``chat_prompt.py`` refuses others by their
    type), so the other kinds' fields are let through here to be named in that refusal."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    text: Text | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: Name
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an assistant turn made (the history of an agent loop)."""

    model_config = _STRICT
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = _STRICT
    # the roles chat templates know; any other string would be written into the prompt as a role of its own
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant turn that made tool calls (chat_prompt.py checks)
    content: Text | Annotated[list[ContentPart], Field(max_length=256)] | None = None
    name: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: Name
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model through its chat template
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = _STRICT
    name: Name


class ChosenTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: ChosenFunction


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Name
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(BaseRequest):
    # one prompt (text or token ids) or a batch of them; the choices are indexed prompt-major (prompt k's
    # choice j is choice k * n + j), as OpenAI's
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)] | TokenIds | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]], Field(min_length=1,
                                                                                  max_length=MAX_PROMPTS)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's limit
    echo: bool = False  # the prompt before each choice's text (and its logprobs, with logprobs)


class Feedback(BaseModel):
    model_config = _STRICT

    response_id: str = Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)
    choice: int = Field(default=0, ge=0, le=MAX_N - 1)
    reward: float = Field(ge=-MAX_REWARD, le=MAX_REWARD, allow_inf_nan=False)
    group_id: Id | None = None
    group_size: int | None = Field(default=None, ge=1, le=MAX_N)
    end_conversation: bool = False  # serve.grouping conversation: write the conversation's responses now


# what each route reads (the error answers and the generated test follow it)
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest, "/feedback": Feedback}
