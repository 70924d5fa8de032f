"""A rollout worker: one member of the ``<run>.rollout`` consumer group. Start more anywhere to scale out.

The worker keeps its engine full (continuous batching, ``rollout.batching: continuous``): requests are admitted
as they are polled, up to ``rollout.requests_in_flight`` (one more is read and waits, so it starts the moment a
slot frees while the next is fetched), each request's workflow runs in a
``WorkflowPool`` whose engine calls join the running batch (vLLM: at the next scheduler step), and a request is
committed as soon as its own samples are done. For each request read:
1. skip it as CANCELLED if the explorer already cancelled its step (over-rollout);
2. FAIL, with the reason, a request that asks for more than ``limits`` allow (samples, turns, prompt tokens);
3. make sure the engine serves at least ``min_model_version``: new weights load only while nothing runs (no
   sample mixes two versions), so admission stops until the engine is drained, then the worker swaps (verified,
   waiting at most ``limits.max_version_wait_s``, after which the requests that need it FAIL with the reason);
4. run its workflow ``repeat_times`` times (a request whose prompt breaks the engine fails alone);
5. in ONE transaction with every other request done since the last one: its Experiences (keyed by group_id),
   its RolloutResult, the dead letter of a failed request, the worker's metrics, and the consumed offsets.

Offsets. Requests finish out of order, so a partition's committed offset is that of its lowest unfinished
request, and the commit's metadata lists the requests above it that are done (``request_ledger``): a worker
killed mid-flight leaves nothing of an unfinished request visible, and whoever reads the partition next redoes
exactly the unfinished ones. A rebalance that takes a partition away drops its unfinished requests here (the
next owner redoes them). ``rollout.batching: batch`` takes ``requests_per_batch`` requests at a time and commits
them together once all are done (the engine idles while the slowest finishes).

Requests are checked where they are read (``streamrft.validation.check_request``): a bad one goes to
``rollouts.dlq`` once and the worker goes on. Between requests the worker follows ``sync`` through its
``WeightFollower``, which loads only weights this run's trainer published.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import statistics
import time
import uuid
import zlib
from functools import partial

from prometheus_client import Counter

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine, SamplingParams, create_engine
from streamrft.engines.workflows.base import WorkflowError, WorkflowSample
from streamrft.engines.workflows.scheduler import WorkflowPool
from streamrft.engines.workflows.limits import WorkLimits
from streamrft.kafka import KafkaClients, RecordProducer, dead_letter
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus
from streamrft.validation import check_request
from .model_paths import resolve_model_path
from .request_ledger import RequestLedger
from .runtime import RoleRuntime
from .weight_follower import WeightFollower

logger = logging.getLogger(__name__)

# (experiences, result, dead letter or None) of one request
Outcome = tuple[list, RolloutResult, object]


def _past(deadline_ms: int | None) -> bool:
    """Whether a request's deadline (epoch milliseconds, set by the explorer) has passed."""
    return bool(deadline_ms) and time.time() * 1000 >= deadline_ms


def default_worker_id() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def build_engine(config: RunConfig) -> InferenceEngine:
    """The configured engine; the common options (batch size, dtype, device) mapped onto each engine's names."""
    settings = config.rollout
    if settings.engine == "fake":
        return create_engine("fake", latency_s=settings.fake_latency_s)
    if settings.engine == "openai":
        remote = settings.openai
        return create_engine("openai", resolve_model_path(config.model.path), base_url=remote.base_url,
                             model=remote.model, timeout_s=remote.timeout_s, max_concurrency=settings.max_batch_size,
                             api_key=remote.api_key.get_secret_value() if remote.api_key else None)
    kwargs = {"dtype": config.model.dtype, "device": settings.device}
    if settings.engine == "vllm":
        kwargs.update(settings.vllm.model_dump(), max_num_seqs=settings.max_batch_size)
    else:
        kwargs["max_batch_size"] = settings.max_batch_size
    return create_engine(settings.engine, resolve_model_path(config.model.path), **kwargs)


def request_sampling(sampling: SamplingParams, seed: int | None, request_id: str) -> SamplingParams:
    """With ``rollout.sampling.seed``, the request's own seed (sample j draws from it + j): the same samples
    whichever worker runs the request, whatever it is batched with."""
    if seed is None:
        return sampling
    return sampling.replace(seed=zlib.crc32(f"{seed}/{request_id}".encode()) << 8)  # room for 256 samples


def work_limits(config: RunConfig) -> WorkLimits:
    limits = config.limits
    return WorkLimits(max_repeat_times=limits.max_repeat_times, max_turns=limits.max_turns,
                      max_prompt_tokens=limits.max_prompt_tokens, max_episode_tokens=limits.max_episode_tokens)


class RolloutWorker:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, worker_id: str | None = None,
                 engine: InferenceEngine | None = None):
        self.config = config
        self.settings = config.rollout
        self.stop = stop
        self.worker_id = worker_id or default_worker_id()
        self.runtime = RoleRuntime(
            config, clients, stop, role="rollout", source=self.worker_id,
            transactional_id=f"{config.name}.rollout.{self.worker_id}",  # one ACL prefix for every worker
            # A killed worker's open transaction blocks read_committed readers until it times out.
            producer_extra={"transaction.timeout.ms": self.settings.transaction_timeout_ms})
        self.sync = self.runtime.sync
        self.engine = engine or build_engine(config)
        if engine is None:  # an engine handed in is its owner's to release
            self.runtime.on_close("engine", self.engine.close)
        self.limits = work_limits(config)
        self.sampling = SamplingParams(temperature=self.settings.sampling.temperature,
                                       top_p=self.settings.sampling.top_p, top_k=self.settings.sampling.top_k,
                                       max_tokens=self.settings.sampling.max_tokens)
        self.consumer = self.runtime.consumer(
            "rollouts", RolloutRequest, config.group("rollout"), client_id=self.worker_id,
            check=partial(check_request, max_task_bytes=config.limits.max_task_bytes),
            # Prefetch little: what is fetched but not read is what another member could be rolling out.
            extra={"queued.max.messages.kbytes": 256, "queued.min.messages": 2 * self.settings.requests_in_flight})
        self.runtime.bind(self.consumer)
        self.pool = WorkflowPool(self.engine, self.limits)
        self.runtime.on_close("workflows", self.pool.close)
        self.ledger = RequestLedger()
        self._backlog: list[Delivered[RolloutRequest]] = []  # read, not started
        # (topic, partition, offset, admission) -> the request and when it started
        self._running: dict[tuple[str, int, int, int], tuple[Delivered[RolloutRequest], float]] = {}
        self._outcomes: list[tuple[tuple[str, int, int], Outcome, int]] = []  # (where, outcome, step), to commit
        self._admissions = itertools.count()
        self._last_commit = time.monotonic()
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
        self.c_busy = Counter("streamrft_rollout_busy_seconds", "seconds the engine ran with requests in flight",
                              registry=self.runtime.registry)
        self.runtime.serve(self.settings.metrics_port)

    @property
    def endpoint(self):
        return self.runtime.endpoint

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, max_requests: int | None = None) -> int:
        self.sync.catch_up()
        self._follow_weights(swap=True)
        logger.info("%s: ready (engine %s, weights v%d, %s batching)", self.worker_id, self.engine.kind,
                    self.engine.version, self.settings.batching)
        while not self.stop.requested and (max_requests is None or self.handled < max_requests):
            self._read(self._room(max_requests))
            self.sync.poll(0)
            # fully_async serves the newest weights as soon as the engine is drained (new weights never land
            # under a running request); admission stops for a swap that is due (see _needs_swap)
            self._follow_weights(swap=self.config.explorer.sync_style == "fully_async" and not self.pool.running)
            self._admit()
            self._collect()
            self._commit()
        return self.handled

    def _room(self, max_requests: int | None) -> int:
        """How many more requests to read now."""
        taken = self.pool.running + len(self._backlog) + len(self._outcomes)
        if self.settings.batching == "batch":
            room = self.settings.requests_per_batch if taken == 0 else 0
        else:  # one more than the engine takes, read and waiting: it starts the moment a request is done
            room = self.settings.requests_in_flight + 1 - self.pool.running - len(self._backlog)
            if any(self.ledger.full(p) for p in self.consumer.assigned):
                room = 0
        if max_requests is not None:
            room = min(room, max_requests - self.handled - taken)
        return max(room, 0)

    def _read(self, room: int) -> None:
        """Poll up to ``room`` requests into the backlog. With no room the partitions are paused (librdkafka
        stops fetching: the worker's backpressure) and the poll only serves the group's callbacks."""
        if room > 0 and self.consumer.paused:
            self.consumer.resume()
        elif room == 0 and not self.consumer.paused:
            self.consumer.pause()
        idle = not (self.pool.running or self._backlog or self._outcomes)
        items = self.consumer.poll(max_records=max(room, 1), timeout=0.5 if idle else 0.0)
        # rebalance callbacks run inside the poll: before anything else is committed, what was revoked is
        # forgotten (Kafka accepts a member's offset commit for a partition another member now owns)
        self._forget_revoked()
        items = [i for i in items if (i.topic, i.partition) in self.consumer.assigned]
        unknown = sorted({(i.topic, i.partition) for i in items if not self.ledger.knows((i.topic, i.partition))})
        if unknown:
            for partition, (offset, metadata) in self.consumer.committed(unknown).items():
                self.ledger.load(partition, offset, metadata)
        for item in items:
            if self.ledger.admit((item.topic, item.partition), item.offset):
                self._backlog.append(item)
            else:
                logger.info("%s: request %s at %s is running or was committed before; skipped", self.worker_id,
                            item.record.request_id, item.where)
        self.ledger.saw(self.consumer.positions())
        self.consumer.forget_pending()  # the ledger says what to commit

    def _forget_revoked(self) -> None:
        """Partitions taken by a rebalance: their unfinished requests are the next owner's (or ours again,
        read anew from the committed point)."""
        revoked = self.consumer.take_revoked()
        if not revoked:
            return
        mine = lambda where: (where[0], where[1]) in revoked  # noqa: E731
        dropped = {key for key in self._running if mine(key)}
        self.pool.cancel(dropped)
        for key in dropped:
            del self._running[key]
        self._backlog = [i for i in self._backlog if not mine((i.topic, i.partition))]
        self._outcomes = [o for o in self._outcomes if not mine(o[0])]
        self.ledger.forget(revoked)
        if dropped:
            logger.info("%s: %d unfinished request(s) of revoked partitions dropped (their next reader redoes "
                        "them)", self.worker_id, len(dropped))

    def _follow_weights(self, swap: bool) -> None:
        self.weights.follow(self.sync)
        if swap:
            self.weights.swap_to_latest(self.sync)
        self._note_refusals()

    def _admit(self) -> None:
        """Start the backlog's requests (1.-4. of the module docstring), in the order they were read."""
        if self.settings.batching == "batch" and (self.pool.running or self._outcomes):
            return
        while self._backlog:
            item = self._backlog[0]
            request = item.record
            if request.kind == RolloutKind.TRAIN and request.step <= self.sync.cancelled_step:  # 1.
                self._done(item, self._cancelled(request))
            elif _past(request.deadline_ms):
                self._done(item, self._timed_out(request))
            elif (why := self._over_limit(request)) is not None:  # 2.
                self._done(item, self._failed(item, why, "over-limit"))
            elif self.settings.batching == "continuous" and self.pool.running >= self.settings.requests_in_flight:
                return  # the engine is full; this one waits for the next request to finish
            elif self._needs_swap(request):  # 3.
                if self.pool.running:
                    return  # drain first: the weights change only while nothing runs
                self._swap_for(request)
                continue
            else:  # 4.
                # unique per admission: a request given back to this worker by a rebalance is admitted anew
                # while its cancelled first run may still be winding down under the old key
                key = (item.topic, item.partition, item.offset, next(self._admissions))
                self._running[key] = (item, time.monotonic())
                self.pool.start(key, request.task, request.repeat_times, self._sampling_for(request))
            self._backlog.pop(0)

    def _sampling_for(self, request: RolloutRequest) -> SamplingParams:
        return request_sampling(self.sampling, self.settings.sampling.seed, request.request_id)

    def _needs_swap(self, request: RolloutRequest) -> bool:
        if not self.weights.serves(request.min_model_version, self.sync):
            return True
        return self.config.explorer.sync_style == "fully_async" and self.weights.newer_due(self.sync)

    def _swap_for(self, request: RolloutRequest) -> None:
        """The engine is drained: load the weights ``request`` needs (or the newest, fully_async); what still
        cannot be served after ``limits.max_version_wait_s`` FAILS with the reason."""
        if self.config.explorer.sync_style == "fully_async":
            self.weights.swap_to_latest(self.sync)
            self._note_refusals()
        needed = request.min_model_version
        wait_s = self.config.limits.max_version_wait_s
        if self.weights.ensure_version(needed, self.sync, self.stop, wait_s) or self.stop.requested:
            if self.stop.requested:
                self._backlog.clear()  # nothing committed: redelivered to whoever takes the partitions
            return
        why = (f"weights v{needed} were needed; after {wait_s:.0f}s (limits.max_version_wait_s) this worker "
               f"serves v{self.engine.version} (the newest published is v{self.sync.version})")
        late = [i for i in self._backlog if i.record.min_model_version > self.engine.version]
        for item in late:
            self._done(item, self._failed(item, why, "version-wait"))
        self._backlog = [i for i in self._backlog if i not in late]

    def _collect(self) -> None:
        """Step the engine; the requests whose workflows finished become outcomes."""
        busy_elsewhere = bool(self._backlog) and self.settings.batching == "continuous"
        started_driving, running = time.monotonic(), self.pool.running
        finished = self.pool.drive(timeout=0.0 if busy_elsewhere else 0.05)
        if running:
            self.c_busy.inc(time.monotonic() - started_driving)
        for key, output in finished:
            item, started = self._running.pop(key)
            if isinstance(output, WorkflowError):
                outcome = self._failed(item, f"{output}\n{output.cause_traceback}", "workflow-error")
            else:
                outcome = self._succeeded(item.record, output)
            outcome[1].duration_ms = int((time.monotonic() - started) * 1000)
            self._done(item, outcome)
        self._stop_late()

    def _stop_late(self) -> None:
        """Requests past their deadline (``rollout.task_timeout_s``) are stopped and reported TIMEOUT; what
        they sampled so far is dropped. (An engine call that is running finishes first: the transformers
        engine generates a call whole, vLLM stops it at its next step.)"""
        late = {key for key, (item, _) in self._running.items() if _past(item.record.deadline_ms)}
        if not late:
            return
        self.pool.cancel(late)
        for key in late:
            item, started = self._running.pop(key)
            outcome = self._timed_out(item.record)
            outcome[1].duration_ms = int((time.monotonic() - started) * 1000)
            self._done(item, outcome)

    def _done(self, item: Delivered[RolloutRequest], outcome: Outcome) -> None:
        where = (item.topic, item.partition, item.offset)
        self.ledger.finish(where[:2], item.offset)
        self._outcomes.append((where, outcome, item.record.step))

    def _commit(self) -> None:
        """5.: every outcome since the last commit, with the ledger's commit points, in one transaction."""
        self._note_refusals()
        if self.settings.batching == "batch" and (self.pool.running or self._backlog):
            return  # a batch commits whole
        if not self._outcomes:
            if self._refusal_letters:  # nothing to commit but the letters: they go alone
                self.runtime.transaction(self._produce_refusals, "dead letters of refused weights")
            return
        outcomes, self._outcomes = self._outcomes, []
        points = self.ledger.commit_points()
        elapsed = time.monotonic() - self._last_commit

        def produce(producer: RecordProducer) -> None:
            self._produce_refusals(producer)
            for _, (experiences, result, letter), _ in outcomes:
                for experience in experiences:
                    producer.produce(self.config.topic("experiences"), experience)
                producer.produce(self.config.topic("results"), result)
                if letter is not None:
                    producer.send_dead_letter(letter)
            samples = sum(len(experiences) for _, (experiences, _, _), _ in outcomes)
            self.runtime.metrics.publish(max(step for _, _, step in outcomes), {
                "rollout_worker/requests": len(outcomes), "rollout_worker/samples": samples,
                "rollout_worker/in_flight": self.pool.running,
                "rollout_worker/samples_per_s": samples / max(elapsed, 1e-6)})

        self.runtime.transaction(produce, f"{len(outcomes)} request(s) up to step "
                                          f"{max(step for _, _, step in outcomes)}", offsets=points)
        self.ledger.committed(points)
        self._last_commit = time.monotonic()
        self.handled += len(outcomes)
        for _, (_, result, _), _ in outcomes:
            self.c_requests.labels(result.status.value).inc()
            logger.info("%s: %s %s (step %d) -> %s, reward %.2f", self.worker_id, result.kind.value.lower(),
                        result.request_id, result.step, result.status.value, result.reward_mean)

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

    def _over_limit(self, request: RolloutRequest) -> str | None:
        try:
            self.limits.check_repeat_times(request.repeat_times)
        except ValueError as exc:
            return str(exc)
        return None

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

    def _timed_out(self, request: RolloutRequest) -> Outcome:
        late_ms = int(time.time() * 1000) - (request.deadline_ms or 0)
        logger.warning("%s: request %s (step %d) stopped %d ms past its deadline (rollout.task_timeout_s)",
                       self.worker_id, request.request_id, request.step, late_ms)
        return [], self._result(request, RolloutStatus.TIMEOUT, [], error="past its deadline "
                                                                         "(rollout.task_timeout_s)"), None

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
