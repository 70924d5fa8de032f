"""The HTTP side of serve mode: an OpenAI-compatible API (FastAPI) over a :class:`ServeRole`.

``/v1/chat/completions`` and ``/v1/completions`` (``stream`` or not, ``n`` choices, ``logprobs``), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus) and ``POST /feedback``. Requests are jobs of the role's serving loop, so
concurrent clients share the engine's batch. A streamed response sends each choice's text as the engine
produces its tokens (``stream.TextDeltas``), with ``usage`` in a last chunk when the client asks
(``stream_options.include_usage``); a client that disconnects stops its request in the engine.
``system_fingerprint`` is the weights version (``v3``) that generated the choices.

Bounds: a body over ``serve.max_body_bytes`` is 413; more than ``serve.max_n`` choices or a prompt over
``serve.max_prompt_tokens`` is 400; ``max_tokens`` is capped at ``serve.max_tokens``; a full engine and queue
answer 429 with Retry-After; a request past ``serve.request_timeout_s`` is 504 (or an error event, streamed).
With ``serve.api_key`` set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from streamrft.engines.inference import Completion
from streamrft.engines.serving import JobStopped, Overloaded

from .api_models import BaseRequest, ChatRequest, CompletionRequest, Feedback
from .feedback import FeedbackError
from .role import ServeRole
from .stream import TextDeltas


def _finish(completion: Completion) -> str:
    return "length" if completion.truncated else "stop"


def _usage(prompt_tokens: int, completions: list[Completion]) -> dict[str, int]:
    generated = sum(len(c.response_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
           headers: dict[str, str] | None = None) -> HTTPException:
    return HTTPException(status, detail={"message": message, "type": kind, "code": code}, headers=headers)


class _Events:
    """What the engine's thread tells one request, handed to the event loop that serves it: ("tokens", choice,
    ids, logprobs) as they come, then ("done", completions, error)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def tokens(self, _prompt: int, choice: int, ids: list[int], logprobs: list[float]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", choice, ids, logprobs))

    def done(self, completions: list[Completion] | None, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", completions, error))

    async def result(self) -> list[Completion]:
        while True:
            kind, *rest = await self.queue.get()
            if kind == "done":
                completions, error = rest
                if error is not None:
                    raise error
                return completions


class _BodyLimit:
    """413 for a request body over ``max_bytes`` (declared, or counted as it is received)."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except self._TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        response = JSONResponse(status_code=413, content={"error": {
            "message": f"the request body is over serve.max_body_bytes ({self.max_bytes:,} bytes)",
            "type": "invalid_request_error", "code": "request_too_large"}})
        await response(scope, receive, send)


class _Chat:
    """What a chat completion looks like (``/v1/chat/completions``)."""

    endpoint, object, chunk_object = "chat", "chat.completion", "chat.completion.chunk"

    def __init__(self, request: ChatRequest) -> None:
        self.request = request
        self._started: set[int] = set()  # choices whose first chunk (with the role) went out

    def logprobs(self, texts: list[str], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(texts, logprobs)]}

    def choice(self, index: int, completion: Completion, texts: list[str]) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": self.logprobs(texts, completion.logprobs), "finish_reason": _finish(completion)}

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


class _Text:
    """What a text completion looks like (``/v1/completions``)."""

    endpoint, object, chunk_object = "completions", "text_completion", "text_completion"

    def __init__(self, request: CompletionRequest) -> None:
        self.request = request

    def logprobs(self, texts: list[str], logprobs: list[float]) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def choice(self, index: int, completion: Completion, texts: list[str]) -> dict[str, Any]:
        return {"index": index, "text": completion.text, "logprobs": self.logprobs(texts, completion.logprobs),
                "finish_reason": _finish(completion)}

    def chunk_choice(self, index: int, text: str, texts: list[str], logprobs: list[float],
                     finish: str | None) -> dict[str, Any] | None:
        if not text and finish is None and self.request.logprobs is None:
            return None
        return {"index": index, "text": text, "finish_reason": finish,
                "logprobs": self.logprobs(texts, logprobs) if texts else None}


Dialect = _Chat | _Text


class _Completions:
    """One request's way through the role: checked, submitted to the serving loop, answered whole or streamed
    (see the module docstring), in the request's dialect."""

    def __init__(self, role: ServeRole) -> None:
        self.role = role
        self.decode = role.engine.decode

    async def respond(self, request: BaseRequest, prompt_ids: list[int], max_tokens: int | None, dialect: Dialect):
        self._check(request, prompt_ids)
        events, job, head = self._submit(dialect.endpoint, request, prompt_ids, max_tokens)
        usage = lambda done: _usage(len(prompt_ids), done)  # noqa: E731
        if not request.stream:
            done = await self._completions_of(events, job)
            return {**head, "system_fingerprint": f"v{done[0].model_version}", "object": dialect.object,
                    "choices": [dialect.choice(i, c, self._pieces(c)) for i, c in enumerate(done)],
                    "usage": usage(done)}

        def chunk(choices: list[dict], **extra) -> dict[str, Any]:
            return {**head, "system_fingerprint": f"v{job.version}", "object": dialect.chunk_object,
                    "choices": choices, **extra}

        chunks = self._streamed(events, request.n, request.stops(), dialect, chunk,
                                (lambda done: chunk([], usage=usage(done))) if request.include_usage else None)
        return self._sse(chunks, job)

    def _check(self, request: BaseRequest, prompt_ids: list[int]) -> None:
        role = self.role
        if request.model and request.model != role.model_name:
            raise _error(404, f"model {request.model!r} is not served here; this server serves {role.model_name!r}",
                         code="model_not_found")
        if request.n > role.settings.max_n:
            raise _error(400, f"n = {request.n}: a request may ask for at most {role.settings.max_n} choices "
                              "(serve.max_n)")
        if not prompt_ids:
            raise _error(422, "the prompt is empty")
        if len(prompt_ids) > role.max_prompt_tokens:
            raise _error(400, f"a prompt of {len(prompt_ids)} tokens; at most {role.max_prompt_tokens} "
                              "(serve.max_prompt_tokens)", code="context_length_exceeded")

    def _pieces(self, completion: Completion) -> list[str]:
        """The text of each response token, so that they add up to the decoded response."""
        out, before = [], ""
        for i in range(1, len(completion.response_ids) + 1):
            text = self.decode(completion.response_ids[:i])
            out.append(text[len(before):])
            before = text
        return out

    def _submit(self, endpoint: str, request: BaseRequest, prompt_ids: list[int], max_tokens: int | None):
        role = self.role
        params = role.params(temperature=request.temperature, top_p=request.top_p, max_tokens=max_tokens,
                             seed=request.seed, stop=request.stops())
        events = _Events()
        try:
            response_id, job = role.generate(endpoint, prompt_ids, params, request.n, on_done=events.done,
                                             on_tokens=events.tokens if request.stream else None,
                                             conversation=request.conversation_id)
        except Overloaded as exc:
            raise _error(429, f"the server is full ({exc}); try again later", kind="rate_limit_error",
                         code="server_overloaded", headers={"Retry-After": str(math.ceil(exc.retry_after_s))})
        head = {"id": response_id, "created": int(time.time()), "model": role.model_name}
        return events, job, head

    async def _completions_of(self, events: _Events, job) -> list[Completion]:
        try:
            return await events.result()
        except JobStopped as exc:
            raise _error(504, str(exc), kind="timeout")
        except asyncio.CancelledError:
            self.role.cancel(job)
            raise

    def _sse(self, chunks: AsyncIterator[dict[str, Any]], job) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            finished = False
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
                finished = True
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away (or the stream broke): the request leaves the engine
                    self.role.cancel(job)
        return StreamingResponse(body(), media_type="text/event-stream")

    async def _streamed(self, events: _Events, n: int, stops: list[str], dialect: Dialect, chunk,
                        usage_chunk) -> AsyncIterator[dict[str, Any]]:
        """Chunks of a streamed request: each choice's new text as it comes (none while nothing is worth a
        chunk), then each choice's rest and finish, then (asked for) ``usage_chunk(completions)``."""
        texts = [TextDeltas(self.decode, stops) for _ in range(n)]
        while True:
            kind, *rest = await events.queue.get()
            if kind == "tokens":
                index, ids, logprobs = rest
                choice = dialect.chunk_choice(index, texts[index].add(ids), [self.decode([i]) for i in ids],
                                              logprobs, None)
                if choice is not None:
                    yield chunk([choice])
                continue
            completions, error = rest
            if error is not None:
                kind = "timeout" if isinstance(error, JobStopped) else "server_error"
                yield {"error": {"message": str(error), "type": kind}}
                return
            for i, completion in enumerate(completions):
                yield chunk([dialect.chunk_choice(i, texts[i].finish(completion.text), [], [], _finish(completion))])
            if usage_chunk is not None:
                yield usage_chunk(completions)
            return


def create_app(role: ServeRole) -> FastAPI:
    app = FastAPI(title="streamrft serve", version="1")
    app.add_middleware(_BodyLimit, max_bytes=role.settings.max_body_bytes)
    key = role.settings.api_key.get_secret_value() if role.settings.api_key else None
    completions = _Completions(role)

    @app.exception_handler(HTTPException)
    async def openai_errors(_request, exc: HTTPException):  # OpenAI's error shape, which its client reads
        body = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        return JSONResponse(status_code=exc.status_code, content={"error": body, "detail": body},
                            headers=exc.headers)

    def authorized(authorization: str | None = Header(default=None)) -> None:
        if key is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), key.encode()):
            raise _error(401, "a valid API key is needed (Authorization: Bearer ...)", code="invalid_api_key")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": role.model_name, "model_version": role.version,
                "pending": len(role.pending), "running": role.serving.running, "waiting": role.serving.waiting}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(role.runtime.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": role.model_name, "object": "model", "created": 0,
                                            "owned_by": "streamrft"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: ChatRequest):
        prompt_ids = role.engine.prompt_ids([{"role": m.role, "content": m.content} for m in request.messages])
        return await completions.respond(request, prompt_ids, request.max_completion_tokens or request.max_tokens,
                                         _Chat(request))

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def text(request: CompletionRequest):
        prompt_ids = list(request.prompt) if isinstance(request.prompt, list) else role.engine.encode(request.prompt)
        return await completions.respond(request, prompt_ids, request.max_tokens, _Text(request))

    @app.post("/feedback", dependencies=[Depends(authorized)])
    def feedback(body: Feedback):
        try:
            answer = role.feedback_desk.feedback(body.response_id, body.choice, body.reward,
                                                 group_id=body.group_id, group_size=body.group_size,
                                                 end_conversation=body.end_conversation)
        except FeedbackError as exc:
            raise _error(exc.status, str(exc))
        return JSONResponse(status_code=answer.status, content=answer.body)

    return app
