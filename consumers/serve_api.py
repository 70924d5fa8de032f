"""The HTTP side of serve mode: an OpenAI-compatible API (FastAPI) over a :class:`ServeRole`.

``/v1/chat/completions`` and ``/v1/completions`` (``stream`` or not, ``n`` choices, ``logprobs``), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus) and ``POST /feedback``. The engines generate a request whole, so a
streamed response sends its tokens as soon as the generation is done, one chunk per token, as a streaming
client expects them; the first byte comes no sooner than the whole answer. ``system_fingerprint`` is the
weights version (``v3``) that generated the choices. With ``serve.api_key`` set, every route but ``/health``
needs ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from streamrft.engines.inference import Completion

from .serve import FeedbackError, ServeRole


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server does not use

    model: str = ""
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=64)
    # serve.grouping conversation: which conversation the request belongs to (the openai client sends it with
    # extra_body={"conversation_id": ...})
    conversation_id: str | None = Field(default=None, min_length=1, max_length=200)
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0)


class Feedback(BaseModel):
    response_id: str = Field(min_length=1)
    choice: int = Field(default=0, ge=0)
    reward: float
    group_id: str | None = None
    group_size: int | None = Field(default=None, ge=1)
    end_conversation: bool = False  # serve.grouping conversation: write the conversation's responses now


def _finish(completion: Completion) -> str:
    return "length" if completion.truncated else "stop"


def _usage(completions: list[Completion]) -> dict[str, int]:
    prompt = len(completions[0].prompt_ids) if completions else 0
    generated = sum(len(c.response_ids) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def create_app(role: ServeRole) -> FastAPI:
    app = FastAPI(title="streamrft serve", version="1")
    key = role.settings.api_key.get_secret_value() if role.settings.api_key else None

    def authorized(authorization: str | None = Header(default=None)) -> None:
        if key is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), key.encode()):
            raise HTTPException(401, detail={"message": "a valid API key is needed (Authorization: Bearer ...)",
                                             "type": "invalid_request_error", "code": "invalid_api_key"})

    def check_model(name: str) -> None:
        if name and name != role.model_name:
            raise HTTPException(404, detail={"message": f"model {name!r} is not served here; this server serves "
                                                        f"{role.model_name!r}", "type": "invalid_request_error",
                                             "code": "model_not_found"})

    def pieces(completion: Completion) -> list[str]:
        """The text of each response token, so that they add up to the decoded response."""
        out, before = [], ""
        for i in range(1, len(completion.response_ids) + 1):
            text = role.engine.decode(completion.response_ids[:i])
            out.append(text[len(before):])
            before = text
        return out

    def sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
        def body() -> Iterator[str]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": role.model_name, "model_version": role.version,
                "pending": len(role.pending)}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(role.runtime.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": role.model_name, "object": "model", "created": 0,
                                            "owned_by": "streamrft"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    def chat(request: ChatRequest):
        check_model(request.model)
        params = role.params(temperature=request.temperature, top_p=request.top_p,
                             max_tokens=request.max_completion_tokens or request.max_tokens, seed=request.seed,
                             stop=request.stops())
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        response_id, completions = role.complete("chat", messages, params, request.n,
                                                  request.conversation_id)
        created, fingerprint = int(time.time()), f"v{completions[0].model_version}"
        head = {"id": response_id, "created": created, "model": role.model_name, "system_fingerprint": fingerprint}

        def logprobs(c: Completion, texts: list[str]) -> dict[str, Any] | None:
            if not request.logprobs:
                return None
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(texts, c.logprobs)]}

        if not request.stream:
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs(c, pieces(c)), "finish_reason": _finish(c)}
                       for i, c in enumerate(completions)]
            return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(completions)}

        def chunks() -> Iterator[dict[str, Any]]:
            chunk = {**head, "object": "chat.completion.chunk"}
            for i, c in enumerate(completions):
                texts = pieces(c)
                yield {**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]}
                for text, lp in zip(texts, c.logprobs):
                    step = {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                                         "top_logprobs": []}]} if request.logprobs else None
                    yield {**chunk, "choices": [{"index": i, "delta": {"content": text}, "logprobs": step,
                                                 "finish_reason": None}]}
                yield {**chunk, "choices": [{"index": i, "delta": {}, "finish_reason": _finish(c)}]}
        return sse(chunks())

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    def completions(request: CompletionRequest):
        check_model(request.model)
        params = role.params(temperature=request.temperature, top_p=request.top_p, max_tokens=request.max_tokens,
                             seed=request.seed, stop=request.stops())
        prompt = request.prompt if isinstance(request.prompt, list) else role.engine.encode(request.prompt)
        if not prompt:
            raise HTTPException(422, detail={"message": "the prompt is empty", "type": "invalid_request_error"})
        response_id, done = role.complete("completions", prompt, params, request.n,
                                               request.conversation_id)
        head = {"id": response_id, "created": int(time.time()), "model": role.model_name,
                "system_fingerprint": f"v{done[0].model_version}"}

        def logprobs(c: Completion, texts: list[str]) -> dict[str, Any] | None:
            if request.logprobs is None:
                return None
            offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
            return {"tokens": texts, "token_logprobs": list(c.logprobs), "top_logprobs": None,
                    "text_offset": offsets}

        if not request.stream:
            choices = [{"index": i, "text": c.text, "logprobs": logprobs(c, pieces(c)), "finish_reason": _finish(c)}
                       for i, c in enumerate(done)]
            return {**head, "object": "text_completion", "choices": choices, "usage": _usage(done)}

        def chunks() -> Iterator[dict[str, Any]]:
            for i, c in enumerate(done):
                for text in pieces(c):
                    yield {**head, "object": "text_completion",
                           "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}
                yield {**head, "object": "text_completion",
                       "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": _finish(c)}]}
        return sse(chunks())

    @app.post("/feedback", dependencies=[Depends(authorized)])
    def feedback(body: Feedback) -> dict[str, Any]:
        try:
            written = role.feedback(body.response_id, body.choice, body.reward, group_id=body.group_id,
                                    group_size=body.group_size, end_conversation=body.end_conversation)
        except FeedbackError as exc:
            raise HTTPException(exc.status, detail={"message": str(exc), "type": "invalid_request_error"})
        if role.settings.grouping == "conversation":  # held until the conversation ends, then written whole
            return {"written": [e.eid for e in written], "group_size": len(written)}
        experience = written[0]
        return {"eid": experience.eid, "group_id": experience.group_id, "group_size": experience.group_size,
                "run_index": experience.run_index, "model_version": experience.model_version}

    return app
