"""A rollout worker: one member of the ``<run>.rollout`` consumer group. Start more anywhere to scale out.

The worker is the Kafka side of a :class:`~streamrft.engines.rollout.RolloutCore`, which carries out the plans
of the rollout scheduler (``engines/rollout/scheduler.py`` has the admission rules): continuous batching,
``rollout.batching: continuous``, lets requests join the running batch as they are read, up to
``rollout.requests_in_flight``; one more is read and waits, so it starts the moment a slot frees. Each pass of
the role loop (``RoleRuntime.run``: ``sync`` and ``control`` polled, ``handle``, then the unit's commit):
1. poll ``rollouts`` into the core (pausing the partitions while the core has no room: the worker's
   backpressure);
2. follow the weights: check a newly announced version at once (``WeightFollower.follow``);
3. step the core: it plans, admits, swaps, steps the engine once and hands back the requests that are done. A
   request waiting for a version not published yet waits in the core, never in the loop: the worker goes on
   polling and committing, and the version is loaded in the pass that sees it;
4. in ONE transaction with every other request done since the last one: each request's Experiences and its
   RolloutResult (``engines/rollout/assembly.py``; under ``explorer.dynamic_sampling`` no experiences of a group
   that carries no gradient), the dead letter of a failed request, the worker's metrics,
   and the consumed offsets.

Offsets. Requests finish out of order, so a partition's committed offset is that of its lowest unfinished
request, and the commit's metadata lists the requests above it that are done (``ledger.py``): whoever reads the
partition next redoes exactly the unfinished ones. A rebalance that takes a partition away drops its unfinished
requests here. ``rollout.batching: batch`` takes ``requests_per_batch`` requests at a time and commits them
together once all are done.

Auxiliary models (a judge, a teacher) are built beside the engine (``auxiliary.py``) and driven by the core's
workflow pool. Requests are checked where they are read (``streamrft.validation.check_request``): a bad one goes
to ``rollouts.dlq`` once. Weights are followed through a ``WeightFollower``, which loads only what this run's
trainer published; what it refuses goes to ``sync.dlq`` (``refusal_letters.py``).
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import uuid
from collections.abc import Hashable

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine, SamplingParams
from streamrft.engines.rollout import Done, OverlongShaping, RolloutCore, assemble
from streamrft.kafka import KafkaClients, dead_letter
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.rollout_stats import informative
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.schemas import RolloutRequest, RolloutResult
from streamrft.weights.follower import FollowedWeights, WeightFollower
from .auxiliary import build_auxiliary, close_all
from .engine_setup import build_engine, request_sampling, rollout_policy
from .ledger import RequestLedger
from .metrics import RolloutMetrics
from .refusal_letters import RefusalLetters

logger = logging.getLogger(__name__)

# (experiences, result, dead letter or None) of one request
Outcome = tuple[list, RolloutResult, object]


def default_worker_id() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


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
        penalty = self.settings.overlong_penalty
        self.shaping = OverlongShaping(penalty, self.settings.sampling.max_tokens) if penalty else None
        sampling = config.explorer.dynamic_sampling
        self.informative_by = sampling.metric if sampling.enabled else None
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
        self.refusal_letters = RefusalLetters(clients, self.sync, config.consumer_group("rollout"))
        self.handled = 0
        self.max_requests: int | None = None
        self.metrics = RolloutMetrics(self.runtime.registry, self.core)
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
        self.metrics.stepped()
        self._stage(unit)  # 4.
        return True

    def finish(self, unit: UnitOfWork) -> None:
        pass

    def rejoin(self, unit: UnitOfWork) -> None:
        """A unit could not commit (``MembershipLost``: the group let this worker go; or the brokers were away
        past its deadline): the unit's results are dropped with the requests still running, and the worker joins again; every request read since the
        last commit is read again from the committed offsets, by this worker or by the member that has its
        partition now."""
        unit.discard()
        self.refusal_letters.discarded()
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
        self.refusal_letters.note(self.weights.take_refusals())

    # 3. what the core is done with ------------------------------------------------------------------------
    def _done(self, done: Done) -> None:
        item = self._read_items.pop(done.key)
        assembled = assemble(done, self.worker_id, self.shaping)
        if self.informative_by and not informative(assembled.result, self.informative_by):
            assembled.experiences = []  # no gradient in it (dynamic sampling): not trained
        self.metrics.assembled(assembled)
        letter = self._dead_letter(item, *assembled.failure) if assembled.failure else None
        where = (item.topic, item.partition, item.offset)
        self.ledger.finish(where[:2], item.offset)
        self._outcomes.append((where, (assembled.experiences, assembled.result, letter), item.record.step))

    def _dead_letter(self, item: Delivered[RolloutRequest], reason: str, error: str):
        """A failed request on ``rollouts.dlq``, with the reason (same transaction as its FAILED result)."""
        logger.warning("%s: request %s at %s failed (%s): %s", self.worker_id, item.record.request_id, item.where,
                       reason, error.splitlines()[0] if error else "")
        return dead_letter(topic=item.topic, partition=item.partition, offset=item.offset,
                           key=(item.key or "").encode(),
                           value=self.runtime.clients.serde.encode(item.record, item.topic),
                           error=error, reason=reason, stage="process", group=self.consumer.group_id)

    # 4. commit --------------------------------------------------------------------------------------------
    def _stage(self, unit: UnitOfWork) -> None:
        """Every outcome since the last commit, with the ledger's commit points, for the unit's transaction."""
        self.refusal_letters.note(self.weights.take_refusals())
        letters = self.refusal_letters.stage(unit)
        if self.settings.batching == "batch" and (self.core.running or self.core.waiting):
            return  # a batch commits whole
        if not self._outcomes:
            if letters:
                unit.describe("dead letters of refused weights")
            return
        outcomes, self._outcomes = self._outcomes, []
        points = self.ledger.commit_points()
        for _, (experiences, result, letter), _ in outcomes:
            for experience in experiences:
                unit.produce(self.config.topic("experiences"), experience)
            unit.produce(self.config.topic("results"), result)
            if letter is not None:
                unit.dead_letter(letter)
        samples = sum(len(experiences) for _, (experiences, _, _), _ in outcomes)
        step = max(step for _, _, step in outcomes)
        unit.metrics(step, self.metrics.of_commit(len(outcomes), samples))
        unit.commit_points(points)
        unit.describe(f"{len(outcomes)} request(s) up to step {step}")
        unit.after_commit(lambda: self._committed(points, outcomes))

    def _committed(self, points, outcomes) -> None:
        self.ledger.committed(points)
        self.handled += len(outcomes)
        self.metrics.committed([result.status.value for _, (_, result, _), _ in outcomes])
        for _, (_, result, _), _ in outcomes:
            logger.info("%s: %s %s (step %d) -> %s, reward %.2f", self.worker_id, result.kind.value.lower(),
                        result.request_id, result.step, result.status.value, result.reward_mean)

    def close(self) -> None:
        """Leave the group at once so the partitions move to the other workers; release the engine."""
        self.runtime.close()
        logger.info("%s: stopped after %d request(s)", self.worker_id, self.handled)

