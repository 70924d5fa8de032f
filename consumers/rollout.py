"""A rollout worker: one member of the ``<run>.rollout`` consumer group. Start more anywhere to scale out.

For each batch of RolloutRequests polled together, read as numbered steps in ``_handle``:
1. skip it as CANCELLED if the explorer already cancelled its step (over-rollout);
2. FAIL, with the reason, a request that asks for more than ``limits`` allow (samples, turns, prompt tokens);
3. make sure the engine serves at least ``min_model_version`` (verified swap; waiting at most
   ``limits.max_version_wait_s``, after which the requests that need it FAIL with the reason);
4. run every request's workflow ``repeat_times`` times, the engine calls batched across requests (a request
   whose prompt breaks the engine fails alone);
5. in ONE transaction: the Experiences (keyed by group_id), the RolloutResults, dead letters of failed requests,
   the worker's metrics and the consumed offsets — a worker killed mid-batch leaves nothing visible, and its
   requests are redelivered.

Requests are checked where they are read (``streamrft.validation.check_request``): a bad one goes to
``rollouts.dlq`` once and the worker goes on. Between requests the worker follows ``sync`` through its
``WeightFollower``, which loads only weights this run's trainer published.
"""
from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time
import uuid
from contextlib import contextmanager
from functools import partial

from prometheus_client import Counter

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine, SamplingParams, create_engine
from streamrft.engines.workflows.base import WorkflowError, WorkflowSample
from streamrft.engines.workflows.batch import run_workflows
from streamrft.engines.workflows.limits import WorkLimits
from streamrft.kafka import KafkaClients, RecordProducer, dead_letter
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus
from streamrft.validation import check_request
from .model_paths import resolve_model_path
from .runtime import RoleRuntime
from .weight_follower import WeightFollower

logger = logging.getLogger(__name__)

# (experiences, result, dead letter or None) of one request
Outcome = tuple[list, RolloutResult, object]


def default_worker_id() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def build_engine(config: RunConfig) -> InferenceEngine:
    """The configured engine; the common options (batch size, dtype, device) mapped onto each engine's names."""
    settings = config.rollout
    if settings.engine == "fake":
        return create_engine("fake", latency_s=settings.fake_latency_s)
    kwargs = {"dtype": config.model.dtype, "device": settings.device}
    if settings.engine == "vllm":
        kwargs.update(settings.vllm.model_dump(), max_num_seqs=settings.max_batch_size)
    else:
        kwargs["max_batch_size"] = settings.max_batch_size
    return create_engine(settings.engine, resolve_model_path(config.model.path), **kwargs)


def work_limits(config: RunConfig) -> WorkLimits:
    limits = config.limits
    return WorkLimits(max_repeat_times=limits.max_repeat_times, max_turns=limits.max_turns,
                      max_prompt_tokens=limits.max_prompt_tokens)


class RolloutWorker:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, worker_id: str | None = None,
                 engine: InferenceEngine | None = None):
        self.config = config
        self.settings = config.rollout
        self.stop = stop
        self.worker_id = worker_id or default_worker_id()
        self.runtime = RoleRuntime(
            config, clients, stop, role="rollout", source=self.worker_id,
            transactional_id=f"{config.name}.{self.worker_id}",
            # A killed worker's open transaction blocks read_committed readers until it times out.
            producer_extra={"transaction.timeout.ms": self.settings.transaction_timeout_ms})
        self.sync = self.runtime.sync
        self.engine = engine or build_engine(config)
        self.runtime.on_close("engine", self.engine.close)
        self.limits = work_limits(config)
        self.sampling = SamplingParams(temperature=self.settings.sampling.temperature,
                                       top_p=self.settings.sampling.top_p, top_k=self.settings.sampling.top_k,
                                       max_tokens=self.settings.sampling.max_tokens)
        self.consumer = self.runtime.consumer(
            "rollouts", RolloutRequest, config.group("rollout"), client_id=self.worker_id,
            check=partial(check_request, max_task_bytes=config.limits.max_task_bytes),
            # Prefetch little: librdkafka stops fetching at these bounds, which is the worker's backpressure
            # while it is busy.
            extra={"queued.max.messages.kbytes": 256, "queued.min.messages": 2 * self.settings.requests_per_batch})
        self.runtime.bind(self.consumer)
        self.weights = WeightFollower(config, self.engine, self.worker_id, self.runtime.registry)
        self.runtime.on_close("weight follower", self.weights.close)
        # refused weight signals go to sync.dlq once for the whole group, however many workers refuse them
        self._refusal_ledger = clients.dead_letter_ledger(config.group("rollout"), config.topic("sync"))
        self._refusal_letters: list = []
        self.handled = 0
        self.c_requests = Counter("streamrft_rollout_requests", "requests handled, by status", ["status"],
                                  registry=self.runtime.registry)
        self.c_tokens = Counter("streamrft_rollout_generated_tokens", "response tokens generated",
                                registry=self.runtime.registry)
        self.c_busy = Counter("streamrft_rollout_busy_seconds", "seconds spent handling requests",
                              registry=self.runtime.registry)
        self.runtime.serve(self.settings.metrics_port)

    @property
    def endpoint(self):
        return self.runtime.endpoint

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, max_requests: int | None = None) -> int:
        self.sync.catch_up()
        self._follow_weights(swap=True)
        logger.info("%s: ready (engine %s, weights v%d)", self.worker_id, self.engine.kind, self.engine.version)
        while not self.stop.requested and (max_requests is None or self.handled < max_requests):
            room = self.settings.requests_per_batch
            if max_requests is not None:
                room = min(room, max_requests - self.handled)
            items = self.consumer.poll(max_records=room, timeout=0.5)
            self.sync.poll(0)
            self._follow_weights(swap=self.config.explorer.sync_style == "fully_async")
            if items:
                with self._paused_while_busy():
                    self._handle(items)
            elif self._refusal_letters:  # nothing read since the last commit: the letters go alone
                self.runtime.transaction(self._produce_refusals, "dead letters of refused weights")
        return self.handled

    def _follow_weights(self, swap: bool) -> None:
        self.weights.follow(self.sync)
        if swap:
            self.weights.swap_to_latest(self.sync)
        self._note_refusals()

    def _note_refusals(self) -> None:
        """Final refusals become dead letters (sent with the next transaction); transient ones are retried."""
        for refusal in self.weights.take_refusals():
            partition, offset = self.sync.where.get(refusal.signal.kind, (0, -1))
            where = (self.sync.topic, partition, offset)
            if refusal.transient or where in self._refusal_ledger:
                continue
            self._refusal_ledger.add(where)
            self._refusal_letters.append(dead_letter(
                topic=self.sync.topic, partition=partition, offset=offset, key=refusal.signal.key.encode(),
                value=self.runtime.clients.serde.encode(refusal.signal, self.sync.topic), error=refusal.detail,
                reason=refusal.reason, stage="weights", group=self.config.group("rollout")))

    def _produce_refusals(self, producer: RecordProducer) -> None:
        for letter in self._refusal_letters:
            producer.send_dead_letter(letter)
        self._refusal_letters = []

    @contextmanager
    def _paused_while_busy(self):
        """Pause our partitions when a batch keeps the engine busy for longer than ``pause_after_s``.

        Pausing drops librdkafka's prefetched messages (they are fetched again on resume), so short batches
        are not paused: the bounded prefetch queue already holds the backpressure for them."""
        paused = threading.Event()

        def pause() -> None:
            self.consumer.pause()
            paused.set()

        timer = threading.Timer(self.settings.pause_after_s, pause)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            timer.join()
            if paused.is_set():
                self.consumer.resume()

    def _handle(self, items: list[Delivered[RolloutRequest]]) -> None:
        started = time.monotonic()
        outcomes: list[Outcome] = []
        runnable = []
        for item in items:
            request = item.record
            if request.kind == RolloutKind.TRAIN and request.step <= self.sync.cancelled_step:  # 1.
                outcomes.append(self._cancelled(request))
            elif (why := self._over_limit(request)) is not None:  # 2.
                outcomes.append(self._failed(item, why, "over-limit"))
            else:
                runnable.append(item)
        if runnable:
            runnable, late = self._with_weights(runnable)  # 3.
            if self.stop.requested:
                return  # nothing committed: the requests are redelivered to whoever takes the partitions
            outcomes += late
            outcomes += self._rollout(runnable)  # 4.
        elapsed_ms = int((time.monotonic() - started) * 1000)

        self._note_refusals()

        def produce(producer: RecordProducer) -> None:  # 5.
            self._produce_refusals(producer)
            for experiences, result, letter in outcomes:
                for experience in experiences:
                    producer.produce(self.config.topic("experiences"), experience)
                producer.produce(self.config.topic("results"), result)
                if letter is not None:
                    producer.send_dead_letter(letter)
            samples = sum(len(experiences) for experiences, _, _ in outcomes)
            self.runtime.metrics.publish(max(i.record.step for i in items), {
                "rollout_worker/batch_ms": elapsed_ms, "rollout_worker/requests": len(items),
                "rollout_worker/samples": samples,
                "rollout_worker/samples_per_s": samples / max(elapsed_ms / 1000, 1e-6)})

        self.runtime.transaction(produce, f"{len(items)} request(s) of step {items[0].record.step}")
        self.handled += len(items)
        self.c_busy.inc(time.monotonic() - started)
        for _, result, _ in outcomes:
            self.c_requests.labels(result.status.value).inc()
            logger.info("%s: %s %s (step %d) -> %s, reward %.2f", self.worker_id, result.kind.value.lower(),
                        result.request_id, result.step, result.status.value, result.reward_mean)

    def _over_limit(self, request: RolloutRequest) -> str | None:
        try:
            self.limits.check_repeat_times(request.repeat_times)
        except ValueError as exc:
            return str(exc)
        return None

    def _with_weights(self, items: list[Delivered[RolloutRequest]]):
        """Wait for the newest ``min_model_version`` among ``items`` (bounded); the requests it still cannot
        serve FAIL with the reason, the rest run."""
        wait_s = self.config.limits.max_version_wait_s
        needed = max(i.record.min_model_version for i in items)
        if self.weights.ensure_version(needed, self.sync, self.stop, wait_s):
            return items, []
        ready = [i for i in items if i.record.min_model_version <= self.engine.version]
        why = (f"weights v{needed} were needed; after {wait_s:.0f}s (limits.max_version_wait_s) this worker "
               f"serves v{self.engine.version} (the newest published is v{self.sync.version})")
        late = [self._failed(i, why, "version-wait") for i in items if i not in ready]
        return ready, late

    def _rollout(self, items: list[Delivered[RolloutRequest]]) -> list[Outcome]:
        """Run the requests' workflows together (engine calls batched across them); one outcome per request."""
        requests = [item.record for item in items]
        started = time.monotonic()
        outputs = run_workflows([r.task for r in requests], self.engine, [r.repeat_times for r in requests],
                                self.sampling, self.limits)
        duration_ms = int((time.monotonic() - started) * 1000)
        outcomes = []
        for item, request, output in zip(items, requests, outputs):
            if isinstance(output, WorkflowError):
                outcome = self._failed(item, f"{output}\n{output.cause_traceback}", "workflow-error")
            else:
                outcome = self._succeeded(request, output)
            outcome[1].duration_ms = duration_ms
            outcomes.append(outcome)
        return outcomes

    def _succeeded(self, request: RolloutRequest, samples: list[WorkflowSample]) -> Outcome:
        self.c_tokens.inc(sum(s.response_length for s in samples))
        experiences = []
        if request.kind == RolloutKind.TRAIN:  # eval rollouts produce results and metrics only
            experiences = [
                sample.to_experience(eid=f"{request.request_id}/{index}", group_id=request.request_id,
                                     task_id=request.task.task_id, step=request.step, kind=request.kind,
                                     run_index=index, worker_id=self.worker_id, model_version=self.engine.version)
                for index, sample in enumerate(samples)
            ]
            for experience in experiences:
                experience.group_size = len(samples)
        return experiences, self._result(request, RolloutStatus.OK, samples), None

    def _failed(self, item: Delivered[RolloutRequest], error: str, reason: str) -> Outcome:
        """A FAILED result with the reason, and the request on ``rollouts.dlq`` (same transaction)."""
        request = item.record
        logger.warning("%s: request %s at %s failed (%s): %s", self.worker_id, request.request_id, item.where,
                       reason, error.splitlines()[0] if error else "")
        letter = dead_letter(topic=item.topic, partition=item.partition, offset=item.offset,
                             key=(item.key or "").encode(),
                             value=self.runtime.clients.serde.encode(request, item.topic),
                             error=error, reason=reason, stage="process", group=self.consumer.group_id)
        return [], self._result(request, RolloutStatus.FAILED, [], error=error), letter

    def _cancelled(self, request: RolloutRequest) -> Outcome:
        return [], self._result(request, RolloutStatus.CANCELLED, []), None

    def _result(self, request: RolloutRequest, status: RolloutStatus, samples: list[WorkflowSample],
                error: str | None = None) -> RolloutResult:
        rewards = [s.reward for s in samples] or [0.0]
        return RolloutResult(
            request_id=request.request_id, step=request.step, task_id=request.task.task_id,
            kind=request.kind, status=status, n=len(samples), model_version=self.engine.version, duration_ms=0,
            reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
            reward_min=min(rewards), reward_max=max(rewards),
            accuracy=statistics.fmean([float(s.correct) for s in samples]) if samples else 0.0,
            response_length_mean=statistics.fmean([s.response_length for s in samples]) if samples else 0.0,
            error=error[-8000:] if error else None, worker_id=self.worker_id)

    def close(self) -> None:
        """Leave the group at once so the partitions move to the other workers; release the engine."""
        self.runtime.close()
        logger.info("%s: stopped after %d request(s)", self.worker_id, self.handled)
