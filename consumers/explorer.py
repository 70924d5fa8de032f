"""The explorer: decides what to roll out and when.

Each step, read as numbered steps in ``run``:
1. wait until the staleness bound and the trainer's backlog allow the step (``streamrft.pacing``);
2. take ``batch_size`` tasks from the current block of ``tasks`` (reading and ordering a new block if needed);
3. in ONE transaction: a RolloutRequest per task, the explorer's state record on ``sync`` and the ``tasks``
   offsets — so a task is either still in the topic, in the state record, or published, never lost or doubled;
4. finish the step from ``results`` (over-rollout may cancel stragglers), then, in one transaction, publish the
   step's metrics and mark the step finished in the state record;
5. every ``eval_interval`` steps, roll out the eval tasksets (kind EVAL, no training experiences).

Its whole state lives in topics: the state record on ``sync`` (compacted), which references the pending tasks
by partition and offset (never embeds them, so it stays small whatever the prompts), and the committed ``tasks``
offsets. Tasks and results are checked where they are read (``streamrft.validation``); a bad one goes to its
DLQ once and the explorer goes on. The explorer also owns the dead letters of ``sync``.
"""
from __future__ import annotations

import logging
import time
import dataclasses
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import Counter, Gauge

from streamrft.config import EvalTaskset, RunConfig
from streamrft.kafka import KafkaClients, RecordProducer
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.pacing import lag_allows, may_publish, required_version
from streamrft.producers.task_files import FieldMapping, read_tasks
from streamrft.rollout_stats import eval_metrics, retry_metrics, step_metrics
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus, SyncKind, SyncSignal, Task
from streamrft.selection import Selector
from streamrft.validation import ExplorerState, check_result, check_task
from .runtime import RoleRuntime

logger = logging.getLogger(__name__)

POLL_S = 0.5


@dataclass
class Outstanding:
    """Requests of one step (or one eval round) and the results collected for them."""

    step: int
    requests: dict[str, RolloutRequest]
    results: dict[str, RolloutResult] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    attempts: list[RolloutResult] = field(default_factory=list)  # failed attempts that were retried
    first_attempt: dict[str, str] = field(default_factory=dict)  # retry's request id -> the first attempt's
    retries: dict[str, int] = field(default_factory=dict)  # first attempt's request id -> retries so far

    @property
    def missing(self) -> list[str]:
        return [rid for rid in self.requests if rid not in self.results]


class Explorer:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, source: str = "explorer"):
        self.config = config
        self.settings = config.explorer
        self.clients = clients
        self.stop = stop
        self.source = source
        self.runtime = RoleRuntime(config, clients, stop, role="explorer", source=source,
                                   transactional_id=f"{config.name}.explorer", owns_sync_dead_letters=True)
        self.sync = self.runtime.sync
        self.metrics = self.runtime.metrics
        self._eval_sets: dict[str, list[Task]] = {}  # eval taskset name -> its tasks (files read once)
        self.tasks = self.runtime.consumer("tasks", Task, config.group("explorer"), client_id=source,
                                           check=partial(check_task, max_bytes=config.limits.max_task_bytes),
                                           extra={"enable.partition.eof": True})
        self.runtime.bind(self.tasks)
        self.results = self.runtime.consumer("results", RolloutResult, config.group("explorer"),
                                             client_id=f"{source}-results", subscribe=False, check=check_result)
        self.selector = Selector(self.settings.selector.kind, self.settings.selector.seed)
        self.state = ExplorerState()
        # (epoch, partition, offset) -> task, for the references in state.pending (a block that spans an epoch
        # boundary of a small topic can hold one record twice)
        self._tasks_by_ref: dict[tuple[int, int, int], Task] = {}
        self._rollout_partitions = len(clients.offsets(config.topic("rollouts")))
        self._next_partition = 0
        registry = self.runtime.registry
        self.g_step = Gauge("streamrft_explorer_step", "next explorer step", registry=registry)
        self.g_version = Gauge("streamrft_explorer_model_version", "latest published weights version",
                               registry=registry)
        self.g_waiting = Gauge("streamrft_explorer_waiting", "1 while held back by staleness or trainer lag",
                               registry=registry)
        self.c_results = Counter("streamrft_explorer_results", "rollout results by status", ["status"],
                                 registry=registry)
        self.runtime.serve(self.settings.metrics_port)

    @property
    def endpoint(self):
        return self.runtime.endpoint

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> ExplorerState:
        self.sync.catch_up()
        self.state = self.sync.explorer
        self._restore_pending()
        self._start_results_reader()
        if self.settings.selector.kind == "difficulty":
            self._replay_results_for_selector()
        if self.state.done:
            logger.info("explorer: the run is already complete (step %d); nothing to do", self.state.next_step)
            return self.state
        if self.state.awaiting is not None:
            logger.info("explorer: resuming; finishing step %d first", self.state.awaiting["step"])
            self._finish_step(self._outstanding_from_state())
        logger.info("explorer: starting at step %d, epoch %d", self.state.next_step, self.state.epoch)
        if self.settings.mode == "explore":
            logger.info("explorer: explore mode: steps are not paced on a trainer (%s pacing and "
                        "max_buffered_batches do not apply; requests take whatever weights the workers serve)",
                        self.settings.sync_style)
        while not self.stop.requested:
            step = self.state.next_step
            if self.settings.total_steps is not None and step >= self.settings.total_steps:
                break
            batch = self._take_batch()  # 2. (first: no point waiting for a step that has no tasks)
            if not batch:
                break  # epochs exhausted
            if not self._wait_until_allowed(step):  # 1.
                break
            outstanding = self._publish_step(step, batch)  # 3.
            self._finish_step(outstanding)  # 4.
            if self._eval_due(step):  # 5.
                self._evaluate(step)
        if not self.stop.requested:
            self._mark_done()
        return self.state

    # 1. pacing ------------------------------------------------------------------------------------------
    def _wait_until_allowed(self, step: int) -> bool:
        s = self.settings
        if s.mode == "explore":  # no trainer: neither weights nor a trainer's lag will ever come
            return not self.stop.requested
        per_step = s.batch_size * s.repeat_times
        logged = False
        while not self.stop.requested:
            self.sync.poll(0)
            version = self._pacing_version()
            self.g_version.set(self.sync.version)
            ahead_ok = may_publish(step, version, s.sync_style, s.sync_interval, s.sync_offset, s.max_staleness)
            lag = self.clients.lag(self.config.group("trainer"), self.config.topic("experiences")) if ahead_ok else 0
            if ahead_ok and lag is not None and lag_allows(lag, s.max_buffered_batches, per_step):
                self.g_waiting.set(0)
                return True
            self.g_waiting.set(1)
            if not logged:
                need = required_version(step, s.sync_style, s.sync_interval, s.sync_offset, s.max_staleness)
                what = "the trainer's requested sync" if s.sync_style == "trainer_driven" else "weights"
                why = (f"{what} v{version} < v{need}" if not ahead_ok else
                       "the trainer's lag is unknown: the cluster does not answer" if lag is None else
                       f"trainer lag {lag} experiences")
                logger.info("explorer: step %d waits (%s)", step, why)
                logged = True
            self.sync.poll(POLL_S)
        return False

    # 2. tasks -------------------------------------------------------------------------------------------
    def _take_batch(self) -> list[tuple[int, Task]]:
        """The next step's (epoch, task) pairs; a block can span an epoch boundary."""
        if not self.state.pending:
            self._read_block()
        refs = self.state.pending[: self.settings.batch_size]
        self.state.pending = self.state.pending[self.settings.batch_size:]
        return [(ref[0], self._tasks_by_ref.pop(tuple(ref))) for ref in refs]

    def _read_block(self) -> None:
        """Fill the state's pending list with the next block of tasks, in the selector's order."""
        s = self.settings
        want = s.batch_size * s.selector.block_steps
        block: list[tuple[int, Delivered[Task]]] = []
        idle_since = time.monotonic()
        while len(block) < want and not self.stop.requested:
            items = self.tasks.poll(max_records=want - len(block), timeout=POLL_S)
            block += [(self.state.epoch, item) for item in items]
            if items:
                idle_since = time.monotonic()
                continue
            if not self.tasks.at_end():
                continue  # still fetching
            if s.total_epochs is None:  # streaming: wait for injected tasks; roll out a partial block when idle
                if block and time.monotonic() - idle_since > s.idle_wait_s:
                    break
                continue
            if self.state.epoch + 1 >= s.total_epochs:
                break  # the last epoch is exhausted (a partial block, or none)
            self.state.epoch += 1
            logger.info("explorer: end of tasks; epoch %d starts", self.state.epoch)
            self.tasks.rewind_to_start()
        by_task = {id(item.record): (epoch, item) for epoch, item in block}
        ordered = self.selector.order([item.record for _, item in block], self.state.epoch,
                                      self.state.next_step // s.selector.block_steps)
        self.state.pending = []
        for task in ordered:
            epoch, item = by_task[id(task)]
            self.state.pending.append([epoch, item.partition, item.offset])
            self._tasks_by_ref[(epoch, item.partition, item.offset)] = task

    def _restore_pending(self) -> None:
        """After a restart: read the tasks the state record references back from ``tasks`` (group-less). A
        task no longer there (retention) or no longer valid is skipped, with a warning."""
        wanted = {(partition, offset) for _, partition, offset in self.state.pending}
        if not wanted:
            return
        topic = self.config.topic("tasks")
        found = self._read_tasks_at(topic, wanted)
        lost = [ref for ref in self.state.pending if (ref[1], ref[2]) not in found]
        if lost:
            logger.warning("explorer: %d pending task(s) are no longer readable on %s (retention?) and are "
                           "skipped: %s", len(lost), topic, ", ".join(f"[{p}]@{o}" for _, p, o in lost[:10]))
        self.state.pending = [ref for ref in self.state.pending if ref not in lost]
        for epoch, partition, offset in self.state.pending:
            self._tasks_by_ref[(epoch, partition, offset)] = found[(partition, offset)]

    def _read_tasks_at(self, topic: str, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], Task]:
        reader = self.clients.consumer([topic], Task, f"{self.config.name}.explorer-restore",
                                       client_id=f"{self.source}-restore", subscribe=False, dead_letters=False,
                                       extra={"enable.partition.eof": True})
        found: dict[tuple[int, int], Task] = {}
        try:
            starts: dict[tuple[str, int], int] = {}
            for partition, offset in wanted:
                starts[(topic, partition)] = min(offset, starts.get((topic, partition), offset))
            reader.assign(starts)
            deadline = time.monotonic() + 60
            while len(found) < len(wanted) and not reader.at_end() and time.monotonic() < deadline:
                for item in reader.poll(max_records=500, timeout=POLL_S):
                    if (item.partition, item.offset) in wanted:
                        found[(item.partition, item.offset)] = item.record
        finally:
            reader.close()
        return found

    # 3. publish -----------------------------------------------------------------------------------------
    def _publish_step(self, step: int, batch: list[tuple[int, Task]]) -> Outstanding:
        s = self.settings
        min_version = self._min_model_version(step)
        requests = {}
        for epoch, task in batch:
            request = RolloutRequest(request_id=f"s{step}-e{epoch}-{task.task_id}", step=step,
                                     kind=RolloutKind.TRAIN, task=task,
                                     repeat_times=task.repeat_times or s.repeat_times,
                                     min_model_version=min_version, deadline_ms=self._deadline_ms())
            requests[request.request_id] = request
        self.state.next_step = step + 1
        self.state.awaiting = {"step": step, "requests": list(requests),
                               "results_offsets": {str(p): o for (_, p), o in self.results.positions().items()}}

        def produce(producer: RecordProducer) -> None:
            self._produce_requests(producer, requests.values())
            self._produce_state(producer)

        self.runtime.transaction(produce, f"publishing step {step}")
        self.g_step.set(self.state.next_step)
        logger.info("explorer: step %d published: %d tasks (epoch %d, weights >= v%d)", step, len(requests),
                    self.state.epoch, min_version)
        return Outstanding(step, requests)

    def _pacing_version(self) -> int:
        """The version pacing counts: under ``trainer_driven`` the one the trainer asked the workers to move to
        (SYNC_REQUEST), not every version it publishes; else the newest published."""
        return self.sync.requested_version if self.settings.sync_style == "trainer_driven" else self.sync.version

    def _min_model_version(self, step: int) -> int:
        s = self.settings
        if s.mode == "explore":
            return 0  # whatever the workers serve
        if s.sync_style == "trainer_driven":
            return self.sync.requested_version  # workers move when the trainer says so, and no further
        return required_version(step, s.sync_style, s.sync_interval, s.sync_offset, s.max_staleness)

    # 4. finish ------------------------------------------------------------------------------------------
    def _finish_step(self, outstanding: Outstanding) -> None:
        s = self.settings
        self._collect(outstanding, minimum=s.min_results, grace_s=s.over_rollout.wait_after_min_s)
        missing = outstanding.missing
        timed_out = time.monotonic() - outstanding.started >= s.step_timeout_s
        if missing and not self.stop.requested:
            status = RolloutStatus.TIMEOUT if timed_out else RolloutStatus.CANCELLED
            logger.info("explorer: step %d finishes with %d of %d results; %d %s", outstanding.step,
                        len(outstanding.results), len(outstanding.requests), len(missing), status.value.lower())
            for rid in missing:
                request = outstanding.requests.get(rid)
                outstanding.results[rid] = RolloutResult(
                    request_id=rid, step=outstanding.step, task_id=request.task.task_id if request else "",
                    status=status, n=0, model_version=self.sync.version, duration_ms=0, worker_id=self.source)
        if self.stop.requested and missing:
            return  # the step stays `awaiting` in the state record; a restart finishes it
        results = list(outstanding.results.values())
        for result in results:
            self.c_results.labels(result.status.value).inc()
            self.selector.observe(result)
        metrics = step_metrics(results, outstanding.step, self.sync.version, len(outstanding.requests))
        metrics.update(retry_metrics(outstanding.attempts))
        metrics["time/step_s"] = time.monotonic() - outstanding.started
        self.state.awaiting = None
        self.state.finished_step = outstanding.step

        def produce(producer: RecordProducer) -> None:
            if missing:
                producer.produce(self.config.topic("sync"), SyncSignal(kind=SyncKind.CANCEL_STEP,
                                                                       version=outstanding.step, source=self.source))
            self.metrics.publish(outstanding.step, metrics)
            self._produce_state(producer)

        self.runtime.transaction(produce, f"finishing step {outstanding.step}")
        logger.info("explorer: step %d done in %.1fs: reward %.3f, accuracy %.3f, %d ok / %d, weights v%d",
                    outstanding.step, metrics["time/step_s"], metrics.get("rollout/reward_mean", float("nan")),
                    metrics.get("rollout/accuracy", float("nan")), int(metrics["rollout/ok"]),
                    len(outstanding.requests), self.sync.version)

    def _collect(self, outstanding: Outstanding, minimum: int, grace_s: float) -> None:
        """Read results until every request has one, or ``minimum`` have arrived and ``grace_s`` passed, or
        the step times out, or a stop is requested."""
        reached_min_at = None
        while outstanding.missing and not self.stop.requested:
            for item in self.results.poll(max_records=500, timeout=POLL_S):
                result = item.record
                if result.request_id in outstanding.requests:
                    if not self._retried(outstanding, result):
                        outstanding.results[result.request_id] = result
                else:  # a straggler of a step that was already finished (over-rollout / timeout)
                    logger.debug("explorer: late result %s of step %d ignored", result.request_id, result.step)
            self.sync.poll(0)
            now = time.monotonic()
            if now - outstanding.started >= self.settings.step_timeout_s:
                return
            if len(outstanding.results) >= minimum:
                reached_min_at = reached_min_at or now
                if now - reached_min_at >= grace_s and len(outstanding.results) < len(outstanding.requests):
                    return

    def _retried(self, outstanding: Outstanding, result: RolloutResult) -> bool:
        """A FAILED or TIMEOUT task with retries left (``explorer.max_retries``) is published again under a new
        request id, which replaces the old one in the step (and in the explorer's state, same transaction). The
        failed attempt is kept for the step's metrics. After an explorer restart the awaited step's requests
        are known by id only: their failures are not retried."""
        request = outstanding.requests.get(result.request_id)
        if request is None or result.status not in (RolloutStatus.FAILED, RolloutStatus.TIMEOUT):
            return False
        first = outstanding.first_attempt.get(result.request_id, result.request_id)
        attempts = outstanding.retries.get(first, 0) + 1
        if attempts > self.settings.max_retries:
            return False
        retry = dataclasses.replace(request, request_id=f"{first}-retry{attempts}", deadline_ms=self._deadline_ms())
        del outstanding.requests[result.request_id]
        outstanding.requests[retry.request_id] = retry
        outstanding.first_attempt[retry.request_id] = first
        outstanding.retries[first] = attempts
        outstanding.attempts.append(result)
        awaited = self.state.awaiting if (self.state.awaiting or {}).get("step") == outstanding.step else None
        if awaited is not None:
            awaited["requests"] = list(outstanding.requests)

        def produce(producer: RecordProducer) -> None:
            self._produce_requests(producer, [retry])
            if awaited is not None:
                self._produce_state(producer)

        self.runtime.transaction(produce, f"retrying {first} ({attempts} of {self.settings.max_retries})")
        logger.info("explorer: %s was %s; retry %d of %d as %s", result.request_id, result.status.value,
                    attempts, self.settings.max_retries, retry.request_id)
        return True

    def _deadline_ms(self) -> int | None:
        timeout = self.config.rollout.task_timeout_s
        return int(time.time() * 1000 + timeout * 1000) if timeout else None

    def _outstanding_from_state(self) -> Outstanding:
        awaiting = self.state.awaiting
        # Requests themselves are not needed to finish: results carry task ids.
        requests = {rid: None for rid in awaiting["requests"]}
        return Outstanding(awaiting["step"], requests)  # type: ignore[arg-type]

    def _start_results_reader(self) -> None:
        """Read ``results`` from where the awaited step's results begin, or from now."""
        offsets = self.clients.offsets(self.config.topic("results"), "end")
        saved = (self.state.awaiting or {}).get("results_offsets", {})
        for (topic, partition) in offsets:
            if str(partition) in saved:
                offsets[(topic, partition)] = int(saved[str(partition)])
        self.results.assign(offsets)

    def _replay_results_for_selector(self) -> None:
        from streamrft.kafka.reader import read_topic

        topic = self.config.topic("results")
        count = 0
        for raw in read_topic(self.config.kafka, self.clients.bootstrap, topic, idle_timeout=1.0):
            try:
                self.selector.observe(self.clients.serde.decode(raw.value, topic, RolloutResult))
                count += 1
            except Exception:  # undecodable history is the DLQ's business, not the selector's
                continue
        logger.info("explorer: difficulty selector rebuilt from %d past results", count)

    # 5. eval --------------------------------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:
        interval = self.settings.eval_interval
        return interval is not None and (step + 1) % interval == 0 and not self.stop.requested

    def _evaluate(self, step: int) -> None:
        for taskset in self.settings.eval_tasksets:
            tasks = self._eval_tasks(taskset)
            requests = {}
            for task in tasks:
                request = RolloutRequest(request_id=f"eval-{taskset.name}-s{step}-{task.task_id}", step=step,
                                         kind=RolloutKind.EVAL, task=task, repeat_times=taskset.repeat_times,
                                         min_model_version=self.sync.version, deadline_ms=self._deadline_ms())
                requests[request.request_id] = request
            self.runtime.transaction(lambda p, r=requests: self._produce_requests(p, r.values()),
                                     f"publishing eval {taskset.name}")
            outstanding = Outstanding(step, requests)
            self._collect(outstanding, minimum=len(requests), grace_s=0)
            metrics = eval_metrics(taskset.name, list(outstanding.results.values()), taskset.repeat_times)
            self.runtime.transaction(lambda p, m=metrics: self.metrics.publish(step, m), "publishing eval metrics")
            logger.info("explorer: eval %s after step %d: %s", taskset.name, step,
                        ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in metrics.items()))

    # -- helpers ------------------------------------------------------------------------------------------
    def _produce_requests(self, producer: RecordProducer, requests) -> None:
        """Round-robin over the partitions (rather than by key hash) so every worker gets an even share."""
        topic = self.config.topic("rollouts")
        for request in requests:
            producer.produce(topic, request, partition=self._next_partition % self._rollout_partitions)
            self._next_partition += 1

    def _produce_state(self, producer: RecordProducer) -> None:
        producer.produce(self.config.topic("sync"), SyncSignal(
            kind=SyncKind.EXPLORER_STATE, version=self.state.next_step, source=self.source,
            state=self.state.to_json()))

    def _mark_done(self) -> None:
        self.state.done = True
        self.runtime.transaction(self._produce_state, "marking the run done")
        logger.info("explorer: done after %d steps", self.state.next_step)

    def _eval_tasks(self, taskset: EvalTaskset) -> list[Task]:
        """An eval set's tasks, read from its file at the first eval round only."""
        if taskset.name not in self._eval_sets:
            self._eval_sets[taskset.name] = load_eval_tasks(taskset)
        return self._eval_sets[taskset.name]

    def close(self) -> None:
        self.runtime.close()


def load_eval_tasks(taskset: EvalTaskset) -> list[Task]:
    mapping = FieldMapping.from_task_file(taskset)
    tasks = [t for t in read_tasks(taskset.path, mapping) if isinstance(t, Task)]
    return tasks[: taskset.max_tasks] if taskset.max_tasks else tasks
