"""Serve mode: the run's inference engine behind an OpenAI-compatible HTTP API (``serve_api``), learning online
from the traffic of an agent application.

Every completion the server returns is kept as a *pending experience* (prompt and response token ids, the
behaviour logprobs, the weights version) under its response id and choice index. ``POST /feedback`` with a
reward turns one into an :class:`Experience` on ``experiences``, in a transaction of its own, so the trainer
trains on it like on a rollout worker's; feedback for an unknown, expired or already rewarded response is
refused (404 / 409), never written twice. Pending experiences expire after ``serve.pending_ttl_s`` (counted).

GRPO needs groups (``serve.grouping``): ``request`` — the ``n`` choices of one request (ask for n > 1 and reward
each); ``count`` — every ``group_size`` rewarded responses in arrival order; ``client`` — the ``group_id`` and
``group_size`` the feedback names; ``conversation`` — the rewarded responses of one conversation (the requests
name it: ``conversation_id`` in the request body), held until the feedback that says ``end_conversation`` and
then written together, so the group's size is the conversation's (advantages compare its turns with each
other). A group's experiences share a ``group_id``; the trainer waits until it is complete (or drops it after
``trainer.group_timeout_s``). Open conversations expire like pending completions, after
``serve.pending_ttl_s`` without feedback (counted).

Weights: a background thread follows ``sync`` and swaps the engine to each new version through the same
``WeightFollower`` as a rollout worker (verified, refusals counted); generation and swaps take one lock, so a
request is never served by two versions and none fails during a swap.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from streamrft.config import RunConfig
from streamrft.engines.inference import Completion, InferenceEngine, Prompt, SamplingParams
from streamrft.engines.workflows.base import WorkflowSample
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.schemas import Experience, RolloutKind

from .rollout import build_engine
from .runtime import RoleRuntime
from .weight_follower import WeightFollower

logger = logging.getLogger(__name__)


class FeedbackError(Exception):
    """A feedback that cannot be used; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Pending:
    completion: Completion
    request_id: str
    choice: int
    choices: int
    created: float
    conversation: str | None = None


class PendingExperiences:
    """Completions waiting for feedback: bounded (the oldest go first) and expiring; each is taken once."""

    def __init__(self, ttl_s: float, capacity: int, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.clock = clock
        self._items: OrderedDict[tuple[str, int], Pending] = OrderedDict()
        self._taken: OrderedDict[tuple[str, int], None] = OrderedDict()  # to tell "already rewarded" from unknown
        self.expired = 0
        self.evicted = 0
        self._lock = threading.Lock()

    def add(self, request_id: str, completions: list[Completion], conversation: str | None = None) -> None:
        now = self.clock()
        with self._lock:
            self._expire(now)
            for i, completion in enumerate(completions):
                self._items[(request_id, i)] = Pending(completion, request_id, i, len(completions), now,
                                                       conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
                self.evicted += 1

    def take(self, request_id: str, choice: int) -> Pending:
        with self._lock:
            self._expire(self.clock())
            key = (request_id, choice)
            if key in self._taken:
                raise FeedbackError(409, f"response {request_id} choice {choice} has had its feedback already")
            pending = self._items.pop(key, None)
            if pending is None:
                raise FeedbackError(404, f"no pending response {request_id} choice {choice}: unknown, or older "
                                         "than serve.pending_ttl_s")
            self._taken[key] = None
            while len(self._taken) > self.capacity:
                self._taken.popitem(last=False)
            return pending

    def give_back(self, pending: Pending) -> None:
        """A feedback whose experience could not be written: it may be sent again."""
        with self._lock:
            key = (pending.request_id, pending.choice)
            self._taken.pop(key, None)
            self._items[key] = pending

    def _expire(self, now: float) -> None:
        while self._items:
            key, oldest = next(iter(self._items.items()))
            if now - oldest.created < self.ttl_s:
                break
            del self._items[key]
            self.expired += 1

    def __len__(self) -> int:
        return len(self._items)


class Grouping:
    """Which GRPO group a rewarded response joins (see the module docstring)."""

    def __init__(self, kind: str, group_size: int, session: str) -> None:
        self.kind = kind
        self.group_size = group_size
        self.session = session
        self._count = itertools.count()
        self._members: dict[str, int] = {}
        self._lock = threading.Lock()

    def assign(self, pending: Pending, group_id: str | None, group_size: int | None) -> tuple[str, int, int]:
        """``(group_id, group_size, run_index)``."""
        if self.kind == "request":
            return pending.request_id, pending.choices, pending.choice
        with self._lock:
            if self.kind == "count":
                n = next(self._count)
                return f"{self.session}-g{n // self.group_size}", self.group_size, n % self.group_size
            if not group_id or not group_size or group_size < 1:
                raise FeedbackError(422, "serve.grouping is client: the feedback must name group_id and "
                                         "group_size >= 1")
            index = self._members.get(group_id, 0)
            if index >= group_size:
                raise FeedbackError(409, f"group {group_id} has its {group_size} responses already")
            self._members[group_id] = index + 1
            return group_id, group_size, index


class Conversations:
    """``serve.grouping: conversation``: the rewarded responses of each open conversation, until it ends (then
    they are written as one group) or expires (``ttl_s`` after its latest feedback)."""

    def __init__(self, ttl_s: float, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._open: OrderedDict[str, tuple[float, list[tuple[Pending, float]]]] = OrderedDict()
        self.expired = 0  # responses of conversations that never ended
        self._lock = threading.Lock()

    def add(self, pending: Pending, reward: float) -> int:
        """Hold a rewarded response; returns how many its conversation holds now."""
        with self._lock:
            self._expire()
            _, held = self._open.pop(pending.conversation, (0.0, []))
            held.append((pending, reward))
            self._open[pending.conversation] = (self.clock(), held)
            return len(held)

    def end(self, conversation: str) -> list[tuple[Pending, float]]:
        with self._lock:
            _, held = self._open.pop(conversation, (0.0, []))
            return held

    def give_back(self, conversation: str, held: list[tuple[Pending, float]]) -> None:
        """An ended conversation whose experiences could not be written: it stays open, to be ended again."""
        with self._lock:
            self._open[conversation] = (self.clock(), held)

    def _expire(self) -> None:
        now = self.clock()
        while self._open:
            conversation, (last, held) = next(iter(self._open.items()))
            if now - last < self.ttl_s:
                break
            del self._open[conversation]
            self.expired += len(held)

    def __len__(self) -> int:
        return sum(len(held) for _, held in self._open.values())


class ServeRole:
    """The Kafka and engine side of ``streamrft serve``; the HTTP side is ``serve_api.create_app``."""

    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *,
                 engine: InferenceEngine | None = None, server_id: str | None = None):
        self.config = config
        self.settings = config.serve
        self.stop = stop
        self.server_id = server_id or f"serve-{uuid.uuid4().hex[:8]}"
        self.model_name = self.settings.model_name or config.name
        self.runtime = RoleRuntime(config, clients, stop, role="serve", source=self.server_id,
                                   transactional_id=f"{config.name}.serve.{self.server_id}")
        self.sync = self.runtime.sync
        self.engine = engine or build_engine(config)
        if engine is None:
            self.runtime.on_close("engine", self.engine.close)
        self.weights = WeightFollower(config, self.engine, self.server_id, self.runtime.registry)
        self.runtime.on_close("weight follower", self.weights.close)
        self.pending = PendingExperiences(self.settings.pending_ttl_s, self.settings.max_pending)
        self.grouping = Grouping(self.settings.grouping, self.settings.group_size, self.server_id)
        self.conversations = Conversations(self.settings.pending_ttl_s)
        self.sampling = config.rollout.sampling
        self._engine_lock = threading.Lock()  # one generation or one swap at a time
        self._produce_lock = threading.Lock()  # the transactional producer is one transaction at a time
        self._follower = threading.Thread(target=lambda: self.runtime.run(_FollowWeights(self)),
                                          name="serve-weights", daemon=True)
        registry = self.runtime.registry
        self.c_requests = Counter("streamrft_serve_requests", "completion requests, by endpoint", ["endpoint"],
                                  registry=registry)
        self.c_tokens = Counter("streamrft_serve_generated_tokens", "response tokens generated", registry=registry)
        self.c_feedback = Counter("streamrft_serve_feedback", "feedback received, by outcome", ["outcome"],
                                  registry=registry)
        Gauge("streamrft_serve_pending", "completions waiting for feedback", registry=registry).set_function(
            lambda: len(self.pending))
        Gauge("streamrft_serve_pending_expired", "completions dropped without feedback (expired or evicted)",
              registry=registry).set_function(lambda: self.pending.expired + self.pending.evicted)
        Gauge("streamrft_serve_conversation_responses", "rewarded responses held until their conversation ends",
              registry=registry).set_function(lambda: len(self.conversations))
        Gauge("streamrft_serve_conversations_expired", "rewarded responses of conversations that never ended",
              registry=registry).set_function(lambda: self.conversations.expired)

    @property
    def version(self) -> int:
        return self.engine.version

    # -- weights --------------------------------------------------------------------------------------------
    def start(self) -> "ServeRole":
        self.sync.catch_up()
        self._swap()
        self._follower.start()
        logger.info("%s: serving %s (engine %s, weights v%d)", self.server_id, self.model_name, self.engine.kind,
                    self.engine.version)
        return self

    def _swap(self) -> None:
        self.weights.follow(self.sync)
        if self.weights.newer_due(self.sync):
            with self._engine_lock:
                self.weights.swap_to_latest(self.sync)
        for refusal in self.weights.take_refusals():
            logger.warning("%s: weights %s v%d refused (%s)", self.server_id, refusal.signal.kind.value,
                           refusal.signal.version, refusal.reason)

    # -- completions -------------------------------------------------------------------------------------------
    def params(self, *, temperature: float | None, top_p: float | None, max_tokens: int | None,
               seed: int | None, stop: list[str] | None) -> SamplingParams:
        """The request's sampling settings over the run's defaults (``rollout.sampling``), bounded by
        ``serve.max_tokens``."""
        tokens = min(max_tokens or self.sampling.max_tokens, self.settings.max_tokens)
        return SamplingParams(temperature=self.sampling.temperature if temperature is None else temperature,
                              top_p=self.sampling.top_p if top_p is None else top_p, top_k=self.sampling.top_k,
                              max_tokens=tokens, seed=seed, stop=tuple(stop or ()))

    def complete(self, endpoint: str, prompt: Prompt, params: SamplingParams, n: int,
                 conversation: str | None = None) -> tuple[str, list[Completion]]:
        """Generate ``n`` choices; returns the response id under which they wait for feedback."""
        self.c_requests.labels(endpoint).inc()
        with self._engine_lock:
            completions = self.engine.generate_one(prompt, params, n=n)
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.pending.add(request_id, completions, conversation)
        self.c_tokens.inc(sum(len(c.response_ids) for c in completions))
        return request_id, completions

    # -- feedback ------------------------------------------------------------------------------------------------
    def feedback(self, response_id: str, choice: int, reward: float, *, group_id: str | None = None,
                 group_size: int | None = None, end_conversation: bool = False) -> list[Experience]:
        """Write the rewarded response as an Experience (one transaction) and return what was written: under
        ``conversation`` grouping nothing until the conversation ends, then all of its responses. FeedbackError
        when it cannot be used; nothing is lost then (the response may get its feedback again)."""
        conversational = self.settings.grouping == "conversation"
        if end_conversation and not conversational:
            self.c_feedback.labels("refused").inc()
            raise FeedbackError(422, "end_conversation needs serve.grouping: conversation (this server groups by "
                                     f"{self.settings.grouping})")
        try:
            pending = self.pending.take(response_id, choice)
        except FeedbackError:
            self.c_feedback.labels("refused").inc()
            raise
        if conversational:
            return self._converse(pending, reward, end_conversation)
        try:
            group, size, index = self.grouping.assign(pending, group_id, group_size)
        except FeedbackError:
            self.pending.give_back(pending)
            self.c_feedback.labels("refused").inc()
            raise
        experience = self._experience(pending, reward, group, size, index)
        self._write([experience], f"the feedback on {response_id}", undo=lambda: self.pending.give_back(pending))
        return [experience]

    def _converse(self, pending: Pending, reward: float, end: bool) -> list[Experience]:
        if not pending.conversation:
            self.pending.give_back(pending)
            self.c_feedback.labels("refused").inc()
            raise FeedbackError(422, "serve.grouping is conversation: the request must name its conversation "
                                     "(conversation_id in the request body)")
        self.conversations.add(pending, reward)
        self.c_feedback.labels("held").inc()
        if not end:
            return []
        held = self.conversations.end(pending.conversation)
        group = f"{self.server_id}-{pending.conversation}"
        experiences = [self._experience(p, r, group, len(held), i) for i, (p, r) in enumerate(held)]
        def undo() -> None:  # the conversation stays open and this feedback may be sent again
            self.conversations.give_back(pending.conversation, held[:-1])
            self.pending.give_back(pending)

        self._write(experiences, f"conversation {pending.conversation}", undo)
        return experiences

    def _write(self, experiences: list[Experience], what: str, undo) -> None:
        def produce(producer) -> None:
            for experience in experiences:
                producer.produce(self.config.topic("experiences"), experience)

        try:
            with self._produce_lock:
                self.runtime.transaction(produce, what)
        except Exception as exc:
            undo()
            self.c_feedback.labels("failed").inc()
            raise FeedbackError(503, f"could not write the experience ({exc}); send the feedback again") from exc
        self.c_feedback.labels("written").inc(len(experiences))

    def _experience(self, pending: Pending, reward: float, group: str, size: int, index: int) -> Experience:
        c = pending.completion
        sample = WorkflowSample(tokens=list(c.prompt_ids) + list(c.response_ids), prompt_length=len(c.prompt_ids),
                                logprobs=list(c.logprobs), reward=reward, truncated=c.truncated,
                                response_text=c.text, model_version=c.model_version)
        sample.validate()
        experience = sample.to_experience(eid=f"{pending.request_id}/{pending.choice}", group_id=group,
                                          task_id=pending.request_id, step=c.model_version,
                                          kind=RolloutKind.TRAIN, run_index=index, worker_id=self.server_id)
        experience.group_size = size
        return experience

    def close(self) -> None:
        self.stop.request()
        if self._follower.is_alive():
            self._follower.join(self.settings.sync_poll_s + 5)
        self.runtime.close()


class _FollowWeights:
    """Serve mode's role loop (``RoleRuntime.run``, on a thread of its own): follow ``sync`` and swap the engine
    to each new version between generations."""

    def __init__(self, serve: ServeRole) -> None:
        self.serve = serve

    def start(self, unit) -> None:
        pass

    def handle(self, unit) -> bool:
        serve = self.serve
        serve.sync.poll(serve.settings.sync_poll_s)
        try:
            serve._swap()
        except Exception:  # noqa: BLE001 - the server keeps serving the weights it has
            logger.exception("%s: following the weights failed; serving v%d", serve.server_id, serve.engine.version)
        return True

    def finish(self, unit) -> None:
        pass
