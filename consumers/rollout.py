"""A rollout worker: one member of the ``<run>.rollout`` consumer group. Start more anywhere to scale out.

For each batch of RolloutRequests polled together, read as numbered steps in ``_handle``:
1. skip it as CANCELLED if the explorer already cancelled its step (over-rollout);
2. make sure the engine serves at least ``min_model_version`` (verified swap from object storage);
3. run every request's workflow ``repeat_times`` times, the engine calls batched across requests;
4. in ONE transaction: the Experiences (keyed by group_id), the RolloutResults, the worker's metrics and the
   consumed offsets — a worker killed mid-batch leaves nothing visible, and its requests are redelivered.

A workflow or reward that raises gives a FAILED result plus a dead letter with the traceback; the worker goes on.
Between requests the worker follows ``sync`` and swaps to newly published weights when its sync style says so.
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
import socket
import statistics
import time
import uuid

from prometheus_client import CollectorRegistry, Counter, Gauge

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine, SamplingParams, create_engine
from streamrft.engines.weights.errors import WeightIntegrityError
from streamrft.engines.weights.object_store import load_weights
from streamrft.engines.workflows.base import WorkflowError, WorkflowSample
from streamrft.engines.workflows.batch import run_workflows
from streamrft.kafka import KafkaClients, RecordProducer, Transactor, dead_letter
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus, SyncMethod, SyncSignal
from streamrft.sync import SyncView
from streamrft.telemetry import MetricsPublisher, serve_prometheus
from .model_paths import resolve_model_path
from .weight_sync import CollectiveReceiver

logger = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def build_engine(config: RunConfig) -> InferenceEngine:
    settings = config.rollout
    if settings.engine == "fake":
        return create_engine("fake", latency_s=settings.fake_latency_s)
    kwargs = {"max_batch_size": settings.max_batch_size, "dtype": config.model.dtype}
    if settings.device != "auto":
        kwargs["device"] = settings.device
    return create_engine(settings.engine, resolve_model_path(config.model.path), **kwargs)


class RolloutWorker:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, worker_id: str | None = None,
                 engine: InferenceEngine | None = None):
        self.config = config
        self.settings = config.rollout
        self.stop = stop
        self.worker_id = worker_id or default_worker_id()
        self.clients = clients
        self.engine = engine or build_engine(config)
        self.sampling = SamplingParams(temperature=self.settings.sampling.temperature,
                                       top_p=self.settings.sampling.top_p, top_k=self.settings.sampling.top_k,
                                       max_tokens=self.settings.sampling.max_tokens)
        self.consumer = clients.consumer([config.topic("rollouts")], RolloutRequest, config.group("rollout"),
                                         client_id=self.worker_id,
                                         # Prefetch little: librdkafka stops fetching at these bounds, which
                                         # is the worker's backpressure while it is busy.
                                         extra={"queued.max.messages.kbytes": 256,
                                                "queued.min.messages": 2 * self.settings.requests_per_batch})
        self.producer = clients.producer(
            transactional_id=f"{config.name}.{self.worker_id}", client_id=self.worker_id,
            # A killed worker's open transaction blocks read_committed readers until it times out.
            extra={"transaction.timeout.ms": self.settings.transaction_timeout_ms})
        self.transactor = Transactor(self.producer, self.consumer)
        self.sync = SyncView(clients, client_id=f"{self.worker_id}-sync")
        self.metrics = MetricsPublisher(self.producer, config.topic("metrics"), self.worker_id, "rollout")
        self._refused_versions: set[int] = set()
        self._receiver: CollectiveReceiver | None = None
        self.handled = 0
        self._prometheus()

    def _prometheus(self) -> None:
        self.registry = CollectorRegistry()
        self.c_requests = Counter("streamrft_rollout_requests", "requests handled, by status", ["status"],
                                  registry=self.registry)
        self.c_tokens = Counter("streamrft_rollout_generated_tokens", "response tokens generated",
                                registry=self.registry)
        self.c_busy = Counter("streamrft_rollout_busy_seconds", "seconds spent handling requests",
                              registry=self.registry)
        self.g_version = Gauge("streamrft_rollout_model_version", "weights version loaded", registry=self.registry)
        self.endpoint = serve_prometheus(self.settings.metrics_port, self.registry)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, max_requests: int | None = None) -> int:
        self.sync.catch_up()
        self.follow_collective()
        self._swap_to_latest()
        logger.info("%s: ready (engine %s, weights v%d)", self.worker_id, self.engine.kind, self.engine.version)
        while not self.stop.requested and (max_requests is None or self.handled < max_requests):
            room = self.settings.requests_per_batch
            if max_requests is not None:
                room = min(room, max_requests - self.handled)
            items = self.consumer.poll(max_records=room, timeout=0.5)
            self.sync.poll(0)
            self.follow_collective()
            if self.config.explorer.sync_style == "fully_async":
                self._swap_to_latest()
            if items:
                with self._paused_while_busy():
                    self._handle(items)
        return self.handled

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
        cancelled = [i for i in items if i.record.kind == RolloutKind.TRAIN
                     and i.record.batch_id <= self.sync.cancelled_step]  # 1.
        runnable = [i for i in items if i not in cancelled]
        outcomes = [self._cancelled(i.record) for i in cancelled]
        if runnable:
            self._ensure_version(max(i.record.min_model_version for i in runnable))  # 2.
            outcomes += self._rollout(runnable)  # 3.
        elapsed_ms = int((time.monotonic() - started) * 1000)

        def produce(producer: RecordProducer) -> None:  # 4.
            for experiences, result, letter in outcomes:
                for experience in experiences:
                    producer.produce(self.config.topic("experiences"), experience)
                producer.produce(self.config.topic("results"), result)
                if letter is not None:
                    producer.send_dead_letter(letter)
            samples = sum(len(experiences) for experiences, _, _ in outcomes)
            self.metrics.publish(max(i.record.batch_id for i in items), {
                "rollout_worker/batch_ms": elapsed_ms, "rollout_worker/requests": len(items),
                "rollout_worker/samples": samples,
                "rollout_worker/samples_per_s": samples / max(elapsed_ms / 1000, 1e-6)})

        if self.transactor.run(produce):
            self.handled += len(items)
            self.c_busy.inc(time.monotonic() - started)
            for _, result, _ in outcomes:
                self.c_requests.labels(result.status.value).inc()
                logger.info("%s: %s %s (step %d) -> %s, reward %.2f", self.worker_id, result.kind.value.lower(),
                            result.request_id, result.batch_id, result.status.value, result.reward_mean)

    def _rollout(self, items: list[Delivered[RolloutRequest]]):
        """Run the requests' workflows together (engine calls batched across them); one outcome per request."""
        requests = [item.record for item in items]
        started = time.monotonic()
        outputs = run_workflows([r.task for r in requests], self.engine, [r.repeat_times for r in requests],
                                self.sampling)
        duration_ms = int((time.monotonic() - started) * 1000)
        outcomes = []
        for item, request, output in zip(items, requests, outputs):
            if isinstance(output, WorkflowError):
                outcome = self._failed(item, output)
            else:
                outcome = self._succeeded(request, output)
            outcome[1].duration_ms = duration_ms
            outcomes.append(outcome)
        return outcomes

    def _succeeded(self, request: RolloutRequest, samples: list[WorkflowSample]):
        self.c_tokens.inc(sum(s.response_length for s in samples))
        experiences = []
        if request.kind == RolloutKind.TRAIN:  # eval rollouts produce results and metrics only
            experiences = [
                sample.to_experience(eid=f"{request.request_id}/{index}", group_id=request.request_id,
                                     task_id=request.task.task_id, batch_id=request.batch_id, kind=request.kind,
                                     run_index=index, worker_id=self.worker_id, model_version=self.engine.version)
                for index, sample in enumerate(samples)
            ]
            for experience in experiences:
                experience.group_size = len(samples)
        return experiences, self._result(request, RolloutStatus.OK, samples), None

    def _failed(self, item: Delivered[RolloutRequest], exc: WorkflowError):
        request = item.record
        logger.warning("%s: request %s at %s failed: %s", self.worker_id, request.request_id, item.where, exc)
        error = f"{exc}\n{exc.cause_traceback}"
        letter = dead_letter(topic=item.topic, partition=item.partition, offset=item.offset,
                             key=(item.key or "").encode(), value=self.clients.serde.encode(request, item.topic),
                             error=error, reason="workflow-error", stage="process", group=self.consumer.group_id)
        return [], self._result(request, RolloutStatus.FAILED, [], error=error), letter

    def _cancelled(self, request: RolloutRequest):
        return [], self._result(request, RolloutStatus.CANCELLED, []), None

    def _result(self, request: RolloutRequest, status: RolloutStatus, samples: list[WorkflowSample],
                error: str | None = None) -> RolloutResult:
        rewards = [s.reward for s in samples] or [0.0]
        return RolloutResult(
            request_id=request.request_id, batch_id=request.batch_id, task_id=request.task.task_id,
            kind=request.kind, status=status, n=len(samples), model_version=self.engine.version, duration_ms=0,
            reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
            reward_min=min(rewards), reward_max=max(rewards),
            accuracy=statistics.fmean([float(s.correct) for s in samples]) if samples else 0.0,
            response_length_mean=statistics.fmean([s.response_length for s in samples]) if samples else 0.0,
            error=error[-8000:] if error else None, worker_id=self.worker_id)

    # -- weights ------------------------------------------------------------------------------------------
    def _ensure_version(self, minimum: int) -> None:
        """Block until the engine serves at least ``minimum`` (the explorer only asks for published ones)."""
        waited = False
        while self.engine.version < minimum and not self.stop.requested:
            self.sync.poll(0.5)
            self.follow_collective()
            if self.sync.version >= minimum:
                self._swap_to_latest()
                if self.engine.version < minimum and self.sync.version in self._refused_versions:
                    logger.error("%s: version %d is needed but was refused; running on v%d", self.worker_id,
                                 self.sync.version, self.engine.version)
                    return
            elif not waited:
                logger.info("%s: waiting for weights v%d (have v%d)", self.worker_id, minimum, self.engine.version)
                waited = True

    def _swap_to_latest(self) -> None:
        signal = self.sync.weights
        if signal is None or signal.version <= self.engine.version or signal.version in self._refused_versions:
            return
        self.load(signal)

    def follow_collective(self) -> None:
        """Join the trainer's weight-sync group as soon as it is announced (NCCL_READY on ``sync``), and again
        when a restarted trainer announces a new one; the receiver takes every broadcast in the background."""
        ready = self.sync.collective_ready
        if ready is None or (self._receiver is not None and self._receiver.ready.state == ready.state):
            return
        # a replaced receiver's thread ends by itself: the trainer that owned its group has left (farewell broadcast)
        device = "cpu" if self.settings.device == "auto" else self.settings.device
        self._receiver = CollectiveReceiver(ready, device=device,
                                            timeout_s=self.config.trainer.weights.collective_timeout_s).start()
        logger.info("%s: joining the trainer's weight-sync group %s", self.worker_id, ready.uri)

    def _fetch(self, signal: SyncSignal):
        """The tensors of a published version: verified from object storage, or received by broadcast."""
        if signal.method != SyncMethod.COLLECTIVE:
            return load_weights(signal.uri, signal.sha256 or None)
        if self._receiver is None:
            raise ValueError(f"weights v{signal.version} were broadcast, but this worker has seen no NCCL_READY")
        _, tensors = self._receiver.wait(signal.version, timeout=self.config.trainer.weights.collective_timeout_s)
        return tensors

    def load(self, signal: SyncSignal) -> bool:
        """Verify and load published weights; a corrupted or truncated upload is refused and the old weights
        stay. Returns whether the swap happened."""
        started = time.monotonic()
        try:
            tensors = self._fetch(signal)
        except (WeightIntegrityError, OSError, ValueError, TimeoutError, RuntimeError) as exc:
            self._refused_versions.add(signal.version)
            logger.error("%s: weights v%d from %s refused: %s; keeping v%d", self.worker_id, signal.version,
                         signal.uri, exc, self.engine.version)
            return False
        self.engine.load_weights(tensors, signal.version)
        self.g_version.set(signal.version)
        logger.info("%s: swapped to weights v%d in %.1fs", self.worker_id, signal.version, time.monotonic() - started)
        return True

    def close(self) -> None:
        """Leave the group at once so the partitions move to the other workers; release the engine."""
        # a collective receiver's daemon thread needs no closing: it ends with the trainer's group or the process
        for closer in (self.consumer.close, self.sync.close, self.engine.close, self.endpoint.close):
            try:
                closer()
            except Exception:
                logger.debug("close failed", exc_info=True)
        logger.info("%s: stopped after %d request(s)", self.worker_id, self.handled)

