"""Serve mode: the run's inference engine behind an OpenAI-compatible HTTP API (``app.py``), learning online
from the traffic of an agent application.

Generation. Requests from every HTTP client are jobs of one :class:`~streamrft.engines.serving.ServingLoop`: the
engine loop (this role's loop, ``RoleRuntime.run`` on a thread of its own) admits them into the running batch
(vLLM's continuous batching; the transformers engine takes every job waiting when its next step starts), steps
the engine, streams each choice's tokens as they come and stops what its client gave up on or what ran past
``serve.request_timeout_s``. At most ``serve.max_running`` requests run and ``serve.max_waiting`` wait; a request
beyond that is refused with 429 and Retry-After. Between engine steps the loop follows ``sync``: when a new
version is due, admission pauses until the running requests are done (a drain bounded by their own
``max_tokens`` and the request timeout), then the engine swaps. So no choice mixes two versions: its behaviour
logprobs are one policy's, and ``system_fingerprint`` (``v3``) and its experience's ``model_version`` name it.

Feedback. Every completion is kept as a *pending experience* (prompt and response token ids, logprobs, version)
under its response id and choice. ``POST /feedback`` with a reward turns one into an :class:`Experience` on
``experiences``, with a :class:`FeedbackReceipt` on ``feedback``, in one transaction; the feedback writer (a
second loop, on its own thread) commits every feedback waiting at once, and the HTTP call answers 200 only once
its transaction is committed. Exactly once: a feedback sent again (a client's retry after a timeout, also to a
restarted server or another one: every server reads the ``feedback`` topic) finds its receipt and is answered the
same, writing nothing; two calls for the same choice at once are one write; a feedback whose commit failed is
given back (503) and may be sent again; an unknown or expired response is 404, another reward for a rewarded one
409.

GRPO needs groups (``serve.grouping``): ``request`` — the ``n`` choices of one request (ask for n > 1 and reward
each); ``count`` — every ``group_size`` rewarded responses in arrival order; ``client`` — the ``group_id`` and
``group_size`` the feedback names; ``conversation`` — the rewarded responses of one conversation (the requests
name it: ``conversation_id`` in the request body), held in memory until the feedback that says
``end_conversation`` (answered 202: held, not yet durable) and then written together (200). Open conversations
expire after ``serve.pending_ttl_s`` without feedback (counted).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from streamrft.config import RunConfig
from streamrft.consumers.rollout import build_engine
from streamrft.engines.inference import Completion, InferenceEngine, SamplingParams
from streamrft.engines.inference.base import TokenListener
from streamrft.engines.serving import Job, ServingLoop, ServingPolicy
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.metric_catalog import prometheus_metric
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.weights.follower import FollowedWeights, WeightFollower

from .feedback import PendingExperiences, Receipts
from .feedback_desk import RECEIPT_POLL_S, FeedbackDesk, FeedbackWriter

logger = logging.getLogger(__name__)


class ServeRole:
    """The Kafka and engine side of ``streamrft serve``: the engine loop, and the feedback desk and its writer
    (``feedback_desk.py``); the HTTP side is ``app.create_app``."""

    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *,
                 engine: InferenceEngine | None = None, server_id: str | None = None):
        self.config = config
        self.settings = settings = config.serve
        self.stop = stop
        self.server_id = server_id or settings.server_id or f"serve-{uuid.uuid4().hex[:8]}"
        self.model_name = settings.model_name or config.name
        self.runtime = RoleRuntime(config, clients, stop, role="serve", source=self.server_id,
                                   transactional_id=f"{config.name}.serve.{self.server_id}")
        self.sync = self.runtime.sync
        self.engine = engine or build_engine(config)
        if engine is None:
            self.runtime.on_close("engine", self.engine.close)
        self.weights = WeightFollower(config, self.engine, self.server_id, self.runtime.registry)
        self.runtime.on_close("weight follower", self.weights.close)
        self.serving = ServingLoop(self.engine, FollowedWeights(self.weights, self.sync, stop), ServingPolicy(
            max_running=settings.max_running, max_waiting=settings.max_waiting,
            request_timeout_s=settings.request_timeout_s, batch_window_s=settings.batch_window_ms / 1000))
        self.pending = PendingExperiences(settings.pending_ttl_s, settings.max_pending)
        self.receipts = Receipts(settings.max_pending)
        self.feedback_desk = FeedbackDesk(settings, self.server_id, self.pending, self.receipts, stop,
                                          self.runtime.registry)
        self.receipt_reader = self.runtime.consumer("feedback", config.consumer_group("serve-receipts"),
                                                    client_id=f"{self.server_id}-receipts", subscribe=False,
                                                    extra={"enable.partition.eof": True})
        self.sampling = config.rollout.sampling
        self.max_prompt_tokens = settings.max_prompt_tokens or config.limits.max_prompt_tokens
        self._threads = [
            threading.Thread(target=lambda: self.runtime.run(_EngineLoop(self), follows_signals=False),
                             name="serve-engine", daemon=True),
            threading.Thread(target=lambda: self.runtime.run(
                FeedbackWriter(self.feedback_desk, config, self._read_receipts), follows_signals=False),
                name="serve-feedback", daemon=True)]
        self._metrics()

    def _metrics(self) -> None:
        registry, serving, conversations = self.runtime.registry, self.serving, self.feedback_desk.conversations
        self.c_requests = prometheus_metric("streamrft_serve_requests", registry)
        self.c_tokens = prometheus_metric("streamrft_serve_generated_tokens", registry)
        gauges = {  # what each reads; their meanings are declared in streamrft/metric_catalog
            "streamrft_serve_running": lambda: serving.running,
            "streamrft_serve_waiting": lambda: serving.waiting,
            "streamrft_serve_batch_size": lambda: serving.last_batch,
            "streamrft_serve_batch_size_max": lambda: serving.largest_batch,
            "streamrft_serve_engine_steps": lambda: serving.steps,
            "streamrft_serve_cancelled": lambda: serving.cancelled,
            "streamrft_serve_timed_out": lambda: serving.timed_out,
            "streamrft_serve_refused": lambda: serving.refused,
            "streamrft_serve_weight_swaps": lambda: serving.swaps,
            "streamrft_serve_swap_pause_seconds_max": lambda: serving.swap_pause_s,
            "streamrft_serve_pending": lambda: len(self.pending),
            "streamrft_serve_pending_expired": lambda: self.pending.expired,
            "streamrft_serve_pending_evicted": lambda: self.pending.evicted,
            "streamrft_serve_receipts": lambda: len(self.receipts),
            "streamrft_serve_conversation_responses": lambda: len(conversations),
            "streamrft_serve_conversations_expired": lambda: conversations.expired,
        }
        for name, read in gauges.items():
            prometheus_metric(name, registry).set_function(read)

    @property
    def version(self) -> int:
        return self.engine.version

    # -- start and stop -------------------------------------------------------------------------------------
    def start(self) -> "ServeRole":
        self.sync.catch_up()
        self.weights.follow(self.sync)
        self.weights.swap_to_latest(self.sync)
        self.receipt_reader.assign(self.runtime.clients.offsets(self.config.topic("feedback"), "start"))
        self._read_receipts(until_end=True)
        for thread in self._threads:
            thread.start()
        logger.info("%s: serving %s (engine %s, weights v%d, %d receipts known)", self.server_id, self.model_name,
                    self.engine.kind, self.engine.version, len(self.receipts))
        return self

    def close(self) -> None:
        self.stop.request()
        self.feedback_desk.wake()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(self.settings.sync_poll_s + 10)
        self.runtime.close()

    def _read_receipts(self, until_end: bool = False) -> None:
        deadline = time.monotonic() + 60
        while True:
            for item in self.receipt_reader.poll(max_records=1000, timeout=RECEIPT_POLL_S if until_end else 0):
                self.receipts.add(item.record)
            if not until_end or self.receipt_reader.at_end() or time.monotonic() > deadline:
                return

    # -- completions -------------------------------------------------------------------------------------------
    def params(self, *, temperature: float | None, top_p: float | None, max_tokens: int | None,
               seed: int | None, stop: list[str] | None, **asked) -> SamplingParams:
        """The request's sampling settings over the run's defaults (``rollout.sampling``), bounded by
        ``serve.max_tokens``; ``asked``: what the client wants besides the samples (``top_logprobs``,
        ``prompt_logprobs``, ``json_schema``)."""
        tokens = min(max_tokens or self.sampling.max_tokens, self.settings.max_tokens)
        return SamplingParams(temperature=self.sampling.temperature if temperature is None else temperature,
                              top_p=self.sampling.top_p if top_p is None else top_p, top_k=self.sampling.top_k,
                              max_tokens=tokens, seed=seed, stop=tuple(stop or ()), **asked)

    def generate(self, endpoint: str, prompts: list[list[int]], params: SamplingParams, n: int, *,
                 on_done: Callable[[list[Completion] | None, BaseException | None], None],
                 on_tokens: TokenListener | None = None, conversation: str | None = None) -> tuple[str, list[Job]]:
        """Queue a request of ``n`` choices of each prompt (a job per prompt); returns its response id and jobs.
        ``on_done`` hears the choices prompt-major (prompt k's choice j is choice ``k * n + j``, also for
        ``on_tokens``) once every job is done, after they are kept for feedback; the first job that fails fails
        the request and stops the others. Raises :class:`~streamrft.engines.serving.Overloaded` when the engine
        and its queue are full (nothing of the request is left queued)."""
        self.c_requests.labels(endpoint).inc()
        response_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        results: list[list[Completion] | None] = [None] * len(prompts)
        jobs: list[Job] = []
        lock = threading.Lock()
        over = False

        def done_for(k: int) -> Callable[[list[Completion] | None, BaseException | None], None]:
            def done(completions: list[Completion] | None, error: BaseException | None) -> None:
                nonlocal over
                with lock:
                    if over:
                        return
                    results[k] = completions
                    if error is None and any(r is None for r in results):
                        return
                    over = True
                if error is not None:
                    for job in jobs:
                        self.serving.cancel(job)
                    on_done(None, error)
                    return
                choices = [c for result in results for c in result]
                self.pending.add(response_id, choices, conversation, per_prompt=n)
                self.c_tokens.inc(sum(len(c.response_ids) for c in choices))
                on_done(choices, None)
            return done

        def tokens_for(k: int) -> TokenListener | None:
            if on_tokens is None:
                return None
            return lambda _prompt, choice, ids, logprobs: on_tokens(0, k * n + choice, ids, logprobs)

        try:
            for k, prompt_ids in enumerate(prompts):
                job = Job(prompt_ids, params, n, on_done=done_for(k), on_tokens=tokens_for(k))
                self.serving.submit(job)
                jobs.append(job)
        except BaseException:
            with lock:
                over = True
            for job in jobs:
                self.serving.cancel(job)
            raise
        return response_id, jobs

    def cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.serving.cancel(job)


class _EngineLoop:
    """Serve mode's role loop: follow ``sync`` (every ``serve.sync_poll_s``) and step the serving loop."""

    def __init__(self, serve: ServeRole) -> None:
        self.serve = serve
        self._next_sync = 0.0

    def start(self, unit: UnitOfWork) -> None:
        pass

    def handle(self, unit: UnitOfWork) -> bool:
        serve = self.serve
        if time.monotonic() >= self._next_sync:
            self._next_sync = time.monotonic() + serve.settings.sync_poll_s
            serve.sync.poll(0)
            serve.weights.follow(serve.sync)
            for refusal in serve.weights.take_refusals():
                logger.warning("%s: weights %s v%d refused (%s)", serve.server_id, refusal.signal.kind.value,
                               refusal.signal.version, refusal.reason)
        try:
            serve.serving.step(timeout=0.05)
        except Exception:  # noqa: BLE001 - a swap that failed: the server keeps serving the weights it has
            logger.exception("%s: following the weights failed; serving v%d", serve.server_id, serve.engine.version)
        return True

    def finish(self, unit: UnitOfWork) -> None:
        self.serve.serving.close()
