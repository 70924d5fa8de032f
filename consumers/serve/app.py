"""The HTTP side of serve mode: an OpenAI-compatible API (FastAPI) over a :class:`ServeRole`.

``/v1/chat/completions`` and ``/v1/completions`` (``stream`` or not, ``n`` choices, ``logprobs`` with alternatives,
a batch of prompts and ``echo`` for text, tools and ``response_format`` for chat: ``request_options.py``,
``chat_prompt.py``, answers shaped by ``openai_format.py``), ``/v1/models`` and ``/v1/models/{model}``,
``/health``, ``/metrics`` (Prometheus) and ``POST /feedback``. Requests are jobs of the role's serving loop, so
concurrent clients share the engine's batch. A streamed response sends each choice's text as the engine
produces its tokens (``stream.TextDeltas``), with ``usage`` in a last chunk when the client asks
(``stream_options.include_usage``); a client that disconnects stops its request in the engine.
``system_fingerprint`` is the weights version (``v3``) that generated the choices.

Bounds: every field of a body is checked before anything reaches the engine or a topic (``api_models.py``; a
refused value is 400, naming the field and what it allows, or that the parameter is not supported, ``errors.py``,
in OpenAI's error shape as every other error); a
body over ``serve.max_body_bytes`` is 413 (declared or chunked); more than ``serve.max_n`` choices, a prompt over
``serve.max_prompt_tokens`` or the model's context, a token id outside the vocabulary, or ``max_tokens`` past the
context left is 400; ``max_tokens`` is capped at ``serve.max_tokens``; a full engine and queue answer 429 with
Retry-After; a request past ``serve.request_timeout_s`` is 504 (or an error event, streamed). No answer carries
exception text. With ``serve.api_key`` set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from streamrft.engines.inference import Completion
from streamrft.engines.serving import JobStopped, Overloaded

from .api_models import BaseRequest, ChatRequest, CompletionRequest, Feedback
from .chat_prompt import ChatPrompts, ToolAnswer
from .errors import INTERNAL, answer, http_error, refused_body
from .errors import error as _error
from .feedback import FeedbackError
from .openai_format import ChatFormat, Format, TextFormat, finish_reason
from .request_options import sampling_options
from .role import ServeRole
from .stream import TextDeltas

logger = logging.getLogger(__name__)


def _usage(prompt_tokens: int, completions: list[Completion]) -> dict[str, int]:
    generated = sum(len(c.response_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


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
    """413 for a request body over ``max_bytes``: declared (Content-Length), or counted as it is received (a
    chunked body). The count raises an HTTPException because FastAPI passes that one through its body parsing
    (any other exception there becomes its 400 "error parsing the body")."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await http_error(self._too_large())(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> HTTPException:
        return _error(413, f"the request body is over serve.max_body_bytes ({self.max_bytes:,} bytes)",
                      code="request_too_large")


class _Completions:
    """One request's way through the role: checked, submitted to the serving loop, answered whole or streamed
    (see the module docstring), in the request's dialect."""

    def __init__(self, role: ServeRole) -> None:
        self.role = role
        self.decode = role.engine.decode

    async def respond(self, request: BaseRequest, prompts: list[list[int]], max_tokens: int | None,
                      dialect: Format, asked: dict[str, Any], names: list[str]):
        """``prompts`` (one, or a batch), ``names[k]``: how prompt k is named in a refusal."""
        for prompt_ids, name in zip(prompts, names):
            self._check(request, prompt_ids, max_tokens, name, len(prompts))
        events, jobs, head = self._submit(dialect.endpoint, request, prompts, max_tokens, asked)
        usage = lambda done: _usage(sum(len(p) for p in prompts), done)  # noqa: E731
        if not request.stream:
            done = await self._completions_of(events, jobs)
            return {**head, "system_fingerprint": f"v{done[0].model_version}", "object": dialect.object,
                    "choices": [dialect.choice(i, c, self._pieces(c)) for i, c in enumerate(done)],
                    "usage": usage(done)}

        def chunk(choices: list[dict], **extra) -> dict[str, Any]:
            return {**head, "system_fingerprint": f"v{jobs[0].version}", "object": dialect.chunk_object,
                    "choices": choices, **extra}

        chunks = self._streamed(events, request.n * len(prompts), request.stops(), dialect, chunk,
                                (lambda done: chunk([], usage=usage(done))) if request.include_usage else None)
        return self._sse(chunks, jobs)

    def _check(self, request: BaseRequest, prompt_ids: list[int], max_tokens: int | None, prompt: str,
               prompts: int) -> None:
        """What the body's own limits cannot know: this server's settings, the model's context and vocabulary.
        Checked here, so that a request the engine would fail never joins (and fails) a batch of others."""
        role, engine = self.role, self.role.engine
        if request.model and request.model != role.model_name:
            raise _error(404, f"model {request.model!r} is not served here; this server serves {role.model_name!r}",
                         code="model_not_found", param="model")
        if request.n * prompts > role.settings.max_n:
            per = f" for each of {prompts} prompts" if prompts > 1 else ""
            raise _error(400, f"n: {request.n} choices{per}; allowed: an integer in [1, "
                              f"{role.settings.max_n // prompts}] (serve.max_n choices in all)", param="n",
                         code="invalid_value")
        if not prompt_ids:
            raise _error(400, f"{prompt}: the prompt is empty", param=prompt, code="invalid_value")
        vocab = engine.vocab_size
        outside = next((i for i, t in enumerate(prompt_ids) if not 0 <= t < vocab), None)
        if outside is not None:
            raise _error(400, f"{prompt}[{outside}]: token id {prompt_ids[outside]} is not in the model's "
                              f"vocabulary; allowed: an integer in [0, {vocab - 1}]", param=f"{prompt}[{outside}]",
                         code="invalid_value")
        context = engine.max_model_len
        limit = min(role.max_prompt_tokens, context - 1) if context else role.max_prompt_tokens
        if len(prompt_ids) > limit:
            raise _error(400, f"{prompt}: a prompt of {len(prompt_ids)} tokens; at most {limit} (serve.max_prompt_"
                              "tokens, and the model's context less one token to generate)", param=prompt,
                         code="context_length_exceeded")
        if max_tokens is not None and context and len(prompt_ids) + max_tokens > context:
            name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
            raise _error(400, f"{name}: {max_tokens} tokens after a prompt of {len(prompt_ids)} is over the model's "
                              f"context of {context}; allowed: an integer in [1, {context - len(prompt_ids)}]",
                         param=name, code="context_length_exceeded")

    def _pieces(self, completion: Completion) -> list[str]:
        """The text of each response token, so that they add up to the decoded response."""
        out, before = [], ""
        for i in range(1, len(completion.response_ids) + 1):
            text = self.decode(completion.response_ids[:i])
            out.append(text[len(before):])
            before = text
        return out

    def _submit(self, endpoint: str, request: BaseRequest, prompts: list[list[int]], max_tokens: int | None,
                asked: dict[str, Any]):
        role = self.role
        params = role.params(temperature=request.temperature, top_p=request.top_p, max_tokens=max_tokens,
                             seed=request.seed, stop=request.stops(), **asked)
        events = _Events()
        try:
            response_id, jobs = role.generate(endpoint, prompts, params, request.n, on_done=events.done,
                                              on_tokens=events.tokens if request.stream else None,
                                              conversation=request.conversation_id)
        except Overloaded as exc:
            raise _error(429, f"the server is full ({exc}); try again later", kind="rate_limit_error",
                         code="server_overloaded", headers={"Retry-After": str(math.ceil(exc.retry_after_s))})
        head = {"id": response_id, "created": int(time.time()), "model": role.model_name}
        return events, jobs, head

    async def _completions_of(self, events: _Events, jobs) -> list[Completion]:
        try:
            return await events.result()
        except JobStopped:
            raise _error(504, self._stopped_message(), kind="timeout")
        except asyncio.CancelledError:
            self.role.cancel(jobs)
            raise
        except Exception:
            logger.exception("serve: a request failed in the engine")
            raise _error(500, INTERNAL, kind="server_error")

    def _stopped_message(self) -> str:
        return (f"the request was stopped: not done within serve.request_timeout_s "
                f"({self.role.settings.request_timeout_s:g}s), or the server is stopping; send it again")

    def _sse(self, chunks: AsyncIterator[dict[str, Any]], jobs) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            finished = False
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
                finished = True
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away (or the stream broke): the request leaves the engine
                    self.role.cancel(jobs)
        return StreamingResponse(body(), media_type="text/event-stream")

    async def _streamed(self, events: _Events, n: int, stops: list[str], dialect: Format, chunk,
                        usage_chunk) -> AsyncIterator[dict[str, Any]]:
        """Chunks of a streamed request: each choice's new text as it comes (none while nothing is worth a
        chunk), then each choice's rest and finish, then (asked for) ``usage_chunk(completions)``. An answer that
        may be a tool call is sent whole when it is done (text sent early could not be taken back)."""
        texts = [TextDeltas(self.decode, stops) for _ in range(n)]
        whole = isinstance(dialect, ChatFormat) and dialect.tools is not None and dialect.tools.enabled
        while True:
            kind, *rest = await events.queue.get()
            if kind == "tokens" and whole:
                continue
            if kind == "tokens":
                index, ids, logprobs = rest
                choice = dialect.chunk_choice(index, texts[index].add(ids), [self.decode([i]) for i in ids],
                                              logprobs, None)
                if choice is not None:
                    yield chunk([choice])
                continue
            completions, error = rest
            if isinstance(error, JobStopped):
                yield {"error": {"message": self._stopped_message(), "type": "timeout", "param": None,
                                 "code": None}}
                return
            if error is not None:
                logger.error("serve: a streamed request failed in the engine", exc_info=error)
                yield {"error": {"message": INTERNAL, "type": "server_error", "param": None, "code": None}}
                return
            for i, completion in enumerate(completions):
                if whole:
                    yield chunk([dialect.whole_chunk_choice(i, completion, self._pieces(completion))])
                    continue
                yield chunk([dialect.chunk_choice(i, texts[i].finish(completion.text), [], [],
                                                  finish_reason(completion))])
            if usage_chunk is not None:
                yield usage_chunk(completions)
            return


def create_app(role: ServeRole) -> FastAPI:
    app = FastAPI(title="streamrft serve", version="1")
    app.add_middleware(_BodyLimit, max_bytes=role.settings.max_body_bytes)
    key = role.settings.api_key.get_secret_value() if role.settings.api_key else None
    completions = _Completions(role)
    chat_prompts = ChatPrompts(role.engine)

    @app.exception_handler(StarletteHTTPException)
    async def openai_errors(_request, exc: StarletteHTTPException):  # OpenAI's error shape, which its client reads
        return http_error(exc)

    @app.exception_handler(RequestValidationError)
    async def refused(request: Request, exc: RequestValidationError):
        return refused_body(request.url.path, exc)

    @app.exception_handler(Exception)
    async def failed(_request, exc: Exception):  # the cause goes to the log, never to the client
        logger.error("serve: a request failed", exc_info=exc)
        return answer(500, {"message": INTERNAL, "type": "server_error", "param": None, "code": None})

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

    served = {"id": role.model_name, "object": "model", "created": 0, "owned_by": "streamrft"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    def model(model: str) -> dict[str, Any]:
        if model != role.model_name:
            raise _error(404, f"model {model!r} is not served here; this server serves {role.model_name!r}",
                         code="model_not_found", param="model")
        return served

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: ChatRequest):
        tools = ToolAnswer(request)
        asked = sampling_options(request, role.engine, tools)
        try:
            prompt_ids = chat_prompts.prompt_ids(request)
        except HTTPException:
            raise
        except Exception:  # noqa: BLE001 - the model's template refuses these messages (its own rules)
            logger.info("serve: the chat template refused a request's messages", exc_info=True)
            raise _error(400, "messages: the model's chat template does not accept these messages (their roles "
                              "or order)", param="messages", code="invalid_value")
        return await completions.respond(request, [prompt_ids], request.max_completion_tokens or request.max_tokens,
                                         ChatFormat(request, role.engine.decode, tools if request.tools else None),
                                         asked, ["messages"])

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def text(request: CompletionRequest):
        asked = sampling_options(request, role.engine)
        given = request.prompt
        batch = isinstance(given, list) and isinstance(given[0], (str, list))
        prompts = list(given) if batch else [given]
        ids = [role.engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else role.engine.decode(p) for p in prompts]
        names = [f"prompt[{k}]" for k in range(len(prompts))] if batch else ["prompt"]
        return await completions.respond(request, ids, request.max_tokens,
                                         TextFormat(request, role.engine.decode, texts), asked, names)

    @app.post("/feedback", dependencies=[Depends(authorized)])
    def feedback(body: Feedback):
        try:
            given = role.feedback_desk.feedback(body.response_id, body.choice, body.reward,
                                                group_id=body.group_id, group_size=body.group_size,
                                                end_conversation=body.end_conversation)
        except FeedbackError as exc:
            raise _error(exc.status, str(exc))
        return JSONResponse(status_code=given.status, content=given.body)

    return app
