"""A rollout worker: one member of the ``<run>.rollout`` consumer group. Start more anywhere to scale out.

The worker is the Kafka side of a :class:`~streamrft.engines.rollout.RolloutCore`, which admits requests,
drives the engine (continuous batching, ``rollout.batching: continuous``: requests join the running batch as
they are read, up to ``rollout.requests_in_flight``; one more is read and waits, so it starts the moment a slot
frees while the next is fetched) and swaps weights only on a drained engine; its docstring has the admission
rules. Each pass of the role loop (``RoleRuntime.run``: ``handle``, then the unit's commit):
1. poll ``rollouts`` into the core (pausing the partitions while the core has no room: the worker's
   backpressure);
2. follow the weights: check a newly announced version at once (``WeightFollower.follow``);
3. step the core: it admits, steps the engine once and hands back the requests that are done;
4. in ONE transaction with every other request done since the last one: each request's Experiences (keyed by
   group_id), its RolloutResult, the dead letter of a failed request, the worker's metrics, and the consumed
   offsets.

Offsets. Requests finish out of order, so a partition's committed offset is that of its lowest unfinished
request, and the commit's metadata lists the requests above it that are done (``request_ledger``): a worker
killed mid-flight leaves nothing of an unfinished request visible, and whoever reads the partition next redoes
exactly the unfinished ones. A rebalance that takes a partition away drops its unfinished requests here (the
next owner redoes them). ``rollout.batching: batch`` takes ``requests_per_batch`` requests at a time and commits
them together once all are done (the engine idles while the slowest finishes).

Auxiliary models (``auxiliary_models``: a judge, a teacher) are built beside the engine (``consumers/auxiliary.py``)
and attached to the core's workflow pool, whose thread drives them too; a sample its reward could not score (a
judge's answer without a score) is no experience, and the request's result names it.

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
import collections
import zlib
from collections.abc import Hashable

from prometheus_client import Counter, Gauge

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine, SamplingParams, create_engine
from streamrft.engines.rollout import Done, RolloutCore, RolloutPolicy
from streamrft.engines.workflows.base import WorkflowSample
from streamrft.kafka import KafkaClients, dead_letter
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.pacing import Pacing
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus
from .auxiliary import build_auxiliary, close_all
from .model_paths import resolve_model_path
from .request_ledger import RequestLedger
from .runtime import RoleRuntime
from .unit_of_work import UnitOfWork
from .weight_follower import FollowedWeights, WeightFollower

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
    if settings.engine == "simulated":
        return create_engine("simulated", step_s=settings.simulated.step_s, min_tokens=settings.simulated.min_tokens,
                             max_num_seqs=settings.max_batch_size)
    if settings.engine == "openai":
        remote = settings.openai
        return create_engine("openai", resolve_model_path(config.model.path), base_url=remote.base_url,
                             model=remote.model, timeout_s=remote.timeout_s, max_concurrency=settings.max_batch_size,
                             api_key=remote.api_key.get_secret_value() if remote.api_key else None)
    kwargs = {"dtype": config.model.dtype, "device": settings.device}
    if settings.engine == "vllm":
        kwargs.update(settings.vllm.model_dump(), max_num_seqs=settings.max_batch_size,
                      in_flight_weights=settings.weight_update == "in_flight")
    else:
        kwargs["max_batch_size"] = settings.max_batch_size
    return create_engine(settings.engine, resolve_model_path(config.model.path), **kwargs)


def request_sampling(sampling: SamplingParams, seed: int | None, request_id: str) -> SamplingParams:
    """With ``rollout.sampling.seed``, the request's own seed (sample j draws from it + j): the same samples
    whichever worker runs the request, whatever it is batched with."""
    if seed is None:
        return sampling
    return sampling.replace(seed=zlib.crc32(f"{seed}/{request_id}".encode()) << 8)  # room for 256 samples


def rollout_policy(config: RunConfig) -> RolloutPolicy:
    settings = config.rollout
    return RolloutPolicy(batching=settings.batching, requests_in_flight=settings.requests_in_flight,
                         requests_per_batch=settings.requests_per_batch,
                         follows_latest=Pacing.of(config).follows_latest,
                         max_version_wait_s=config.limits.max_version_wait_s, weight_update=settings.weight_update)


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
        # judges, teachers (auxiliary_models): built here from the config, handed to the workflows by name
        self.auxiliary = build_auxiliary(config, self.engine)
        self.runtime.on_close("auxiliary models", lambda: close_all(self.auxiliary))
        self.sampling = SamplingParams(temperature=self.settings.sampling.temperature,
                                       top_p=self.settings.sampling.top_p, top_k=self.settings.sampling.top_k,
                                       max_tokens=self.settings.sampling.max_tokens)
        self.consumer = self.runtime.consumer(
            "rollouts", config.consumer_group("rollout"), client_id=self.worker_id,
            check_options={"max_task_bytes": config.limits.max_task_bytes},
            # Prefetch little: what is fetched but not read is what another member could be rolling out.
            extra={"queued.max.messages.kbytes": 256, "queued.min.messages": 2 * self.settings.requests_in_flight})
        self.runtime.bind(self.consumer)
        self.weights = WeightFollower(config, self.engine, self.worker_id, self.runtime.registry)
        self.runtime.on_close("weight follower", self.weights.close)
        self.core = RolloutCore(self.engine, FollowedWeights(self.weights, self.sync, stop), rollout_policy(config),
                                config.limits, stopped=lambda: stop.requested)
        self.runtime.on_close("workflows", self.core.close)
        self.core.pool.attach(self.auxiliary, judge=config.judge, teacher=config.distillation.teacher)
        self.ledger = RequestLedger()
        # the core's key (topic, partition, offset, admission) -> the request as read, while the core holds it
        self._read_items: dict[Hashable, Delivered[RolloutRequest]] = {}
        self._outcomes: list[tuple[tuple[str, int, int], Outcome, int]] = []  # (where, outcome, step), to commit
        self._admissions = itertools.count()
        self._last_commit = time.monotonic()
        self._busy_s = 0.0
        # refused weight signals go to sync.dlq once for the whole group, however many workers refuse them
        self._refusal_ledger = clients.dead_letter_ledger(config.consumer_group("rollout"), config.topic("sync"))
        self._refusal_letters: list = []
        self._staged_letters: list = []  # the refusals' letters in the unit being committed
        self.handled = 0
        self.max_requests: int | None = None
        self.c_requests = Counter("streamrft_rollout_requests", "requests handled, by status", ["status"],
                                  registry=self.runtime.registry)
        self.c_tokens = Counter("streamrft_rollout_generated_tokens", "response tokens generated",
                                registry=self.runtime.registry)
        self.c_failed_samples = Counter("streamrft_rollout_failed_samples", "samples their reward could not "
                                        "score (a judge's answer without a score), by reward; never trained on",
                                        ["reward"], registry=self.runtime.registry)
        self._failures_since_commit: collections.Counter[str] = collections.Counter()  # by reward, for metrics
        self.c_busy = Counter("streamrft_rollout_busy_seconds", "seconds the engine ran with requests in flight",
                              registry=self.runtime.registry)
        Gauge("streamrft_rollout_swaps_in_flight", "weights versions loaded while requests ran "
              "(rollout.weight_update: in_flight)", registry=self.runtime.registry).set_function(
            lambda: self.core.swaps_in_flight)
        self.runtime.serve(self.settings.metrics_port)

    @property
    def endpoint(self):
        return self.runtime.endpoint

    # -- the loop (RoleRuntime.run: poll -> handle -> commit) ----------------------------------------------
    def run(self, max_requests: int | None = None) -> int:
        self.max_requests = max_requests
        self.runtime.run(self)
        return self.handled

    def start(self, unit: UnitOfWork) -> None:
        self.sync.catch_up()
        self._follow_weights()
        self.weights.swap_to_latest(self.sync)
        logger.info("%s: ready (engine %s, weights v%d, %s batching)", self.worker_id, self.engine.kind,
                    self.engine.version, self.settings.batching)

    def handle(self, unit: UnitOfWork) -> bool:
        if self.max_requests is not None and self.handled >= self.max_requests:
            return False
        self._read(self._room())  # 1.
        self._follow_weights()  # 2.
        for done in self.core.step(self.sync.cancelled_step):  # 3.
            self._done(done)
        self.c_busy.inc(self.core.busy_s - self._busy_s)
        self._busy_s = self.core.busy_s
        self._stage(unit)  # 4.
        return True

    def finish(self, unit: UnitOfWork) -> None:
        pass

    def rejoin(self, unit: UnitOfWork) -> None:
        """The group let this worker go and its unit could not commit (``MembershipLost``): the unit's results
        are dropped with the requests still running, and the worker joins again; every request read since the
        last commit is read again from the committed offsets, by this worker or by the member that has its
        partition now."""
        unit.discard()
        self._refusal_letters[:0] = self._staged_letters  # not sent: the next unit sends them
        self._staged_letters = []
        self.consumer.rejoin()
        self._forget_revoked()

    # 1. read ----------------------------------------------------------------------------------------------
    def _room(self) -> int:
        """How many more requests to read now."""
        taken = self.core.running + self.core.waiting + len(self._outcomes)
        if self.settings.batching == "batch":
            room = self.settings.requests_per_batch if taken == 0 else 0
        else:  # one more than the engine takes, read and waiting: it starts the moment a request is done
            room = self.settings.requests_in_flight + 1 - self.core.running - self.core.waiting
            if any(self.ledger.full(p) for p in self.consumer.assigned):
                room = 0
        if self.max_requests is not None:
            room = min(room, self.max_requests - self.handled - taken)
        return max(room, 0)

    def _read(self, room: int) -> None:
        """Poll up to ``room`` requests into the core. With no room the partitions are paused (librdkafka
        stops fetching: the worker's backpressure) and the poll only serves the group's callbacks."""
        if room > 0 and self.consumer.paused:
            self.consumer.resume()
        elif room == 0 and not self.consumer.paused:
            self.consumer.pause()
        idle = self.core.idle and not self._outcomes
        items = self.consumer.poll(max_records=max(room, 1), timeout=0.5 if idle else 0.0)
        # rebalance callbacks run inside the poll: before anything else is committed, what was revoked is
        # forgotten (Kafka accepts a member's offset commit for a partition another member now owns)
        self._forget_revoked()
        items = [i for i in items if (i.topic, i.partition) in self.consumer.assigned]
        unknown = sorted({(i.topic, i.partition) for i in items if not self.ledger.knows((i.topic, i.partition))})
        if unknown:
            for partition, (offset, metadata) in self.consumer.committed(unknown, timeout=60.0).items():
                self.ledger.load(partition, offset, metadata)
        for item in items:
            if self.ledger.admit((item.topic, item.partition), item.offset):
                # unique per admission: a request given back to this worker by a rebalance is admitted anew
                # while its cancelled first run may still be winding down under the old key
                key = (item.topic, item.partition, item.offset, next(self._admissions))
                self._read_items[key] = item
                self.core.add(key, item.record, self._sampling_for(item.record))
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
        dropped = [key for key in self.core.keys() if mine(key)]
        running = self.core.running
        self.core.abort(dropped)
        for key in dropped:
            del self._read_items[key]
        self._outcomes = [o for o in self._outcomes if not mine(o[0])]
        self.ledger.forget(revoked)
        if running != self.core.running:
            logger.info("%s: %d unfinished request(s) of revoked partitions dropped (their next reader redoes "
                        "them)", self.worker_id, running - self.core.running)

    def _sampling_for(self, request: RolloutRequest) -> SamplingParams:
        return request_sampling(self.sampling, self.settings.sampling.seed, request.request_id)

    # 2. weights -------------------------------------------------------------------------------------------
    def _follow_weights(self) -> None:
        self.weights.follow(self.sync)
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
                reason=refusal.reason, stage="weights", group=self.config.consumer_group("rollout")))

    # 3. what the core is done with ------------------------------------------------------------------------
    def _done(self, done: Done) -> None:
        item = self._read_items.pop(done.key)
        request = item.record
        if done.status == RolloutStatus.OK:
            outcome = self._succeeded(item, done.samples, done.version)
        elif done.status == RolloutStatus.FAILED:
            outcome = self._failed(item, done.error or "", done.reason or "failed", done.version)
        else:
            outcome = [], self._result(request, done.status, [], done.version, error=done.error), None
        outcome[1].duration_ms = int(done.duration_s * 1000)
        where = (item.topic, item.partition, item.offset)
        self.ledger.finish(where[:2], item.offset)
        self._outcomes.append((where, outcome, request.step))

    def _succeeded(self, item: Delivered[RolloutRequest], samples: list[WorkflowSample], version: int) -> Outcome:
        """Experiences of the samples the reward scored. A sample it could not score (a judge's answer without a
        score) is left out of the group and named in the result's ``error``; with none scored the request FAILS
        (``reward-failed``)."""
        request = item.record
        self.c_tokens.inc(sum(s.response_length for s in samples))
        scored = [(index, s) for index, s in enumerate(samples) if s.failure is None]
        failures = [(index, s.failure) for index, s in enumerate(samples) if s.failure is not None]
        for _, failure in failures:
            self.c_failed_samples.labels(failure.source).inc()
            self._failures_since_commit[failure.source] += 1
        why = _failures_text(failures, len(samples)) if failures else None
        if not scored:
            return self._failed(item, why, "reward-failed", version)
        experiences = []
        if request.kind == RolloutKind.TRAIN:  # eval rollouts produce results and metrics only
            experiences = [
                sample.to_experience(eid=f"{request.request_id}/{index}", group_id=request.request_id,
                                     task_id=request.task.task_id, step=request.step, kind=request.kind,
                                     run_index=index, worker_id=self.worker_id, default_version=version)
                for index, sample in scored
            ]
            for experience in experiences:
                experience.group_size = len(scored)
        kept = [sample for _, sample in scored]
        return experiences, self._result(request, RolloutStatus.OK, kept, version, error=why), None

    def _failed(self, item: Delivered[RolloutRequest], error: str, reason: str, version: int) -> Outcome:
        """A FAILED result with the reason, and the request on ``rollouts.dlq`` (same transaction)."""
        request = item.record
        logger.warning("%s: request %s at %s failed (%s): %s", self.worker_id, request.request_id, item.where,
                       reason, error.splitlines()[0] if error else "")
        letter = dead_letter(topic=item.topic, partition=item.partition, offset=item.offset,
                             key=(item.key or "").encode(),
                             value=self.runtime.clients.serde.encode(request, item.topic),
                             error=error, reason=reason, stage="process", group=self.consumer.group_id)
        return [], self._result(request, RolloutStatus.FAILED, [], version, error=error), letter

    def _result(self, request: RolloutRequest, status: RolloutStatus, samples: list[WorkflowSample], version: int,
                error: str | None = None) -> RolloutResult:
        rewards = [s.reward for s in samples] or [0.0]
        return RolloutResult(
            request_id=request.request_id, step=request.step, task_id=request.task.task_id,
            kind=request.kind, status=status, n=len(samples), model_version=version, duration_ms=0,
            reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
            reward_min=min(rewards), reward_max=max(rewards),
            accuracy=statistics.fmean([float(s.correct) for s in samples]) if samples else 0.0,
            response_length_mean=statistics.fmean([s.response_length for s in samples]) if samples else 0.0,
            error=error[-8000:] if error else None, worker_id=self.worker_id, taskset=request.task.taskset)

    # 4. commit --------------------------------------------------------------------------------------------
    def _stage(self, unit: UnitOfWork) -> None:
        """Every outcome since the last commit, with the ledger's commit points, for the unit's transaction."""
        self._note_refusals()
        letters, self._refusal_letters = self._refusal_letters, []
        self._staged_letters = letters
        for letter in letters:
            unit.dead_letter(letter)
        if self.settings.batching == "batch" and (self.core.running or self.core.waiting):
            return  # a batch commits whole
        if not self._outcomes:
            if letters:
                unit.describe("dead letters of refused weights")
            return
        outcomes, self._outcomes = self._outcomes, []
        points = self.ledger.commit_points()
        elapsed = time.monotonic() - self._last_commit
        for _, (experiences, result, letter), _ in outcomes:
            for experience in experiences:
                unit.produce(self.config.topic("experiences"), experience)
            unit.produce(self.config.topic("results"), result)
            if letter is not None:
                unit.dead_letter(letter)
        samples = sum(len(experiences) for _, (experiences, _, _), _ in outcomes)
        step = max(step for _, _, step in outcomes)
        failed = {f"{reward}/failed_samples": count for reward, count in self._failures_since_commit.items()}
        self._failures_since_commit.clear()
        unit.metrics(step, {"rollout_worker/requests": len(outcomes), "rollout_worker/samples": samples,
                            "rollout_worker/in_flight": self.core.running,
                            "rollout_worker/samples_per_s": samples / max(elapsed, 1e-6), **failed})
        unit.commit_points(points)
        unit.describe(f"{len(outcomes)} request(s) up to step {step}")
        unit.after_commit(lambda: self._committed(points, outcomes))

    def _committed(self, points, outcomes) -> None:
        self.ledger.committed(points)
        self._last_commit = time.monotonic()
        self.handled += len(outcomes)
        for _, (_, result, _), _ in outcomes:
            self.c_requests.labels(result.status.value).inc()
            logger.info("%s: %s %s (step %d) -> %s, reward %.2f", self.worker_id, result.kind.value.lower(),
                        result.request_id, result.step, result.status.value, result.reward_mean)

    def close(self) -> None:
        """Leave the group at once so the partitions move to the other workers; release the engine."""
        self.runtime.close()
        logger.info("%s: stopped after %d request(s)", self.worker_id, self.handled)


def _failures_text(failures: list, total: int, shown: int = 5) -> str:
    """What a result's ``error`` says of the samples their reward could not score (the first ``shown`` of them:
    the text stays well inside what a result keeps)."""
    listed = "; ".join(f"sample {index}: {failure}" for index, failure in failures[:shown])
    more = f"; and {len(failures) - shown} more" if len(failures) > shown else ""
    return f"{len(failures)} of {total} sample(s) not scored, so not trained on: {listed}{more}"
