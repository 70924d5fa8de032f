"""What a completion request asks of the engine besides its samples, and the refusals (400, naming the field and
why) of what this server cannot do for it. Checked before the request reaches the engine.

Sampling stays the policy's: the logprobs a served answer carries become its experience's behaviour logprobs,
which the trainer recomputes from the model alone, so a penalty or a logit bias (which would change what was
sampled from) is refused unless neutral. Guided decoding (``response_format`` json_object / json_schema, and a
``tool_choice`` that requires a call) needs an engine that does it (vLLM's structured outputs); another engine
refuses it rather than answer without the format.
"""
from __future__ import annotations

import json
from typing import Any

from streamrft.engines.inference import InferenceEngine

from .api_models import BaseRequest, ChatRequest, CompletionRequest
from .chat_prompt import ToolAnswer
from .errors import error

_SAMPLED_AS_THE_POLICY = ("the engine samples from the model's own distribution (a served answer's logprobs "
                          "become its experience's, which training recomputes from the model alone)")


def _refuse(param: str, message: str) -> None:
    raise error(400, f"{param}: {message}", param=param, code="unsupported_value")


def sampling_options(request: BaseRequest, engine: InferenceEngine, tools: ToolAnswer | None = None
                     ) -> dict[str, Any]:
    """``SamplingParams`` fields for what ``request`` asks besides sampling (top_logprobs, prompt_logprobs,
    json_schema); an HTTPException (400) for what cannot be done."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            _refuse(name, f"{_SAMPLED_AS_THE_POLICY}, without penalties; allowed: 0 or null")
    if request.logit_bias:
        _refuse("logit_bias", f"{_SAMPLED_AS_THE_POLICY}, without a bias; allowed: {{}} or null")
    if isinstance(request, CompletionRequest):
        return _text_options(request)
    return _chat_options(request, engine, tools)


def _text_options(request: CompletionRequest) -> dict[str, Any]:
    if request.stream and request.echo:
        _refuse("echo", "the prompt is echoed in whole answers only; send it with stream false")
    if request.stream and request.logprobs:
        _refuse("logprobs", "alternatives are given in whole answers only; with stream, allowed: 0 or null")
    asked: dict[str, Any] = {"top_logprobs": request.logprobs or 0}
    if request.echo and request.logprobs is not None:
        asked["prompt_logprobs"] = request.logprobs
    return asked


def _chat_options(request: ChatRequest, engine: InferenceEngine, tools: ToolAnswer | None) -> dict[str, Any]:
    if request.top_logprobs and not request.logprobs:
        _refuse("top_logprobs", "alternatives come with logprobs: set logprobs true")
    if request.stream and request.top_logprobs:
        _refuse("top_logprobs", "alternatives are given in whole answers only; with stream, allowed: 0 or null")
    asked: dict[str, Any] = {"top_logprobs": (request.top_logprobs or 0) if request.logprobs else 0}
    choice = request.tool_choice
    if choice is not None and not request.tools:
        _refuse("tool_choice", "there are no tools to choose from: send tools, or leave tool_choice out")
    if choice is not None and not isinstance(choice, str) and tools is not None and \
            choice.function.name not in {t.function.name for t in request.tools or []}:
        _refuse("tool_choice.function.name", f"{choice.function.name!r} is not one of the request's tools")
    schema, param = _response_schema(request)
    required = tools.required_schema(request) if tools is not None else None
    if required is not None:
        if schema is not None:
            _refuse("tool_choice", "a required tool call and a response_format cannot both be guided; send one")
        schema, param = required, "tool_choice"
    if schema is not None:
        if not engine.structured_outputs:
            _refuse(param, f"this needs guided decoding, which the {engine.kind} engine does not do (it would "
                           "answer without the format); serve with rollout.engine: vllm, or leave it out")
        asked["json_schema"] = json.dumps(schema)
    return asked


def _response_schema(request: ChatRequest) -> tuple[dict[str, Any] | None, str]:
    form = request.response_format
    if form is None or form.type == "text":
        return None, "response_format"
    if form.type == "json_object":
        return {"type": "object"}, "response_format"
    if form.json_schema is None or form.json_schema.schema_ is None:
        _refuse("response_format.json_schema", "type json_schema needs json_schema.schema (a JSON schema)")
    return form.json_schema.schema_, "response_format"
