"""The explorer: decides what to roll out and when.

Each pass of ``run``, read as numbered steps:
1. while fewer than ``max_inflight_steps`` steps are in flight and the staleness bound and the trainer's
   backlog allow it (``streamrft.pacing``): take ``batch_size`` tasks from the current block of ``tasks``
   (reading and ordering a new block if needed) and publish the step — in ONE transaction: a RolloutRequest per
   task, the explorer's state record on ``control`` and the ``tasks`` offsets, so a task is either still in the
   topic, in the state record, or published, never lost or doubled;
2. collect ``results`` for every step and eval round in flight, re-publishing failed tasks that have retries
   left;
3. finish the oldest step once all its results are in (over-rollout may finish it earlier and cancel
   stragglers; ``step_timeout_s`` reports the rest TIMEOUT) — steps finish in order, so ``finished_step`` means
   every step up to it — publishing its metrics, marking it finished in the state record and, every
   ``eval_interval`` steps, starting an eval round (kind EVAL, no training experiences) in the same transaction;
   eval rounds are collected beside the training steps and report their metrics when complete.

Every transaction of the explorer writes its state record, because every one commits the ``tasks`` offsets:
the record and the offsets always agree. Its whole state lives in topics: the state record on ``control``
(compacted), which references the pending tasks by partition and offset (never embeds them, so it stays small
whatever the prompts) and lists the rounds in flight by request id, and the committed ``tasks`` offsets. A
restart collects the rounds in flight from where their results begin. Tasks and results are checked where they
are read (``streamrft.validation``); a bad one goes to its DLQ once and the explorer goes on. The explorer also
owns the dead letters of ``sync`` and ``control``.
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
    """A round in flight: the requests of one training step (or one eval round) and the results collected."""

    step: int
    requests: dict[str, RolloutRequest | None]  # None: known by id only (restored after a restart)
    results_offsets: dict[str, int] = field(default_factory=dict)  # where its results begin, per partition
    eval_taskset: str | None = None  # the eval round of this taskset, not a training step
    results: dict[str, RolloutResult] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    reached_min_at: float | None = None  # when over-rollout's minimum of results was reached
    attempts: list[RolloutResult] = field(default_factory=list)  # failed attempts that were retried
    first_attempt: dict[str, str] = field(default_factory=dict)  # retry's request id -> the first attempt's
    retries: dict[str, int] = field(default_factory=dict)  # first attempt's request id -> retries so far

    @property
    def missing(self) -> list[str]:
        return [rid for rid in self.requests if rid not in self.results]

    def entry(self) -> dict:
        """This round in the state record's ``in_flight``."""
        entry = {"step": self.step, "requests": list(self.requests), "results_offsets": self.results_offsets}
        if self.eval_taskset is not None:
            entry["eval"] = self.eval_taskset
        return entry

    @classmethod
    def of(cls, entry: dict) -> "Outstanding":
        """A round restored from the state record: its requests are known by id (results carry task ids, so
        that is enough to finish it), and its failures are not retried."""
        return cls(entry["step"], dict.fromkeys(entry["requests"]), dict(entry.get("results_offsets", {})),
                   entry.get("eval"))


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
        self.window: list[Outstanding] = []  # training steps in flight, oldest first
        self.evals: list[Outstanding] = []  # eval rounds in flight
        self._tasks_exhausted = False  # the last epoch's tasks are all published
        self._last_finish = time.monotonic()
        self._noted: tuple[int, str] | None = None  # (step, cause) the explorer last said it waits for
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
        self.g_in_flight = Gauge("streamrft_explorer_steps_in_flight", "training steps published, not finished",
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
        self.window = [Outstanding.of(e) for e in self.state.in_flight if "eval" not in e]
        self.evals = [Outstanding.of(e) for e in self.state.in_flight if "eval" in e]
        self._start_results_reader()
        if self.settings.selector.kind == "difficulty":
            self._replay_results_for_selector()
        if self.state.done:
            logger.info("explorer: the run is already complete (step %d); nothing to do", self.state.next_step)
            return self.state
        if self.state.in_flight:
            logger.info("explorer: resuming; collecting step(s) %s and %d eval round(s) in flight",
                        self.state.steps_in_flight, len(self.evals))
        logger.info("explorer: starting at step %d, epoch %d, up to %d step(s) in flight", self.state.next_step,
                    self.state.epoch, self.settings.max_inflight_steps)
        if self.settings.mode == "explore":
            logger.info("explorer: explore mode: steps are not paced on a trainer (%s pacing and "
                        "max_buffered_batches do not apply; requests take whatever weights the workers serve)",
                        self.settings.sync_style)
        self._last_finish = time.monotonic()
        while not self.stop.requested:
            if self._publish_next_step():  # 1.
                continue
            if self._publishing_over and not self.window and not self.evals:
                break
            self._collect(timeout=POLL_S / 2)  # 2.
            self._finish_ready()  # 3.
        if not self.stop.requested:
            self._mark_done()
        return self.state

    # 1. pacing and publishing -----------------------------------------------------------------------------
    def _publish_next_step(self) -> bool:
        """Publish the next step if the window has room, there are tasks and pacing allows it."""
        s = self.settings
        if self._publishing_over or len(self.window) >= s.max_inflight_steps:
            return False
        step = self.state.next_step
        if s.total_steps is not None and step >= s.total_steps or not self._tasks_ready():
            return False
        cause, held_by = self._held_by(step)
        self.g_waiting.set(1 if cause else 0)
        if cause:
            self._note_waiting(step, cause, held_by)
            return False
        self._publish_step(step, self._take_batch())
        return True

    @property
    def _publishing_over(self) -> bool:
        s = self.settings
        return self._tasks_exhausted or (s.total_steps is not None and self.state.next_step >= s.total_steps)

    def _held_by(self, step: int) -> tuple[str, str]:
        """What keeps step ``step`` from being published now: (cause, what it waits for); ("", "") = nothing."""
        s = self.settings
        if s.mode == "explore":  # no trainer: neither weights nor a trainer's lag will ever come
            return "", ""
        self.sync.poll(0)
        version = self._pacing_version()
        self.g_version.set(self.sync.version)
        if not may_publish(step, version, s.sync_style, s.sync_interval, s.sync_offset, s.max_staleness):
            need = required_version(step, s.sync_style, s.sync_interval, s.sync_offset, s.max_staleness)
            what = "the trainer's sync request for" if s.sync_style == "trainer_driven" else "weights"
            return "weights", f"{what} v{need} (has v{version})"
        lag = self.clients.lag(self.config.group("trainer"), self.config.topic("experiences"))
        if lag is None:
            return "cluster", "the trainer's lag (the cluster does not answer)"
        if not lag_allows(lag, s.max_buffered_batches, s.batch_size * s.repeat_times):
            return "lag", (f"the trainer ({lag} experiences untrained; max_buffered_batches "
                           f"{s.max_buffered_batches})")
        return "", ""

    def _note_waiting(self, step: int, cause: str, held_by: str) -> None:
        """Say once per step and cause what the explorer waits for: in the log, and in the state record for
        the dashboard (a transaction of its own, since every transaction writes the state)."""
        if self._noted == (step, cause):
            return
        self._noted = (step, cause)
        self.state.waiting = held_by
        logger.info("explorer: step %d waits for %s (in flight: %s)", step, held_by,
                    [o.step for o in self.window] or "none")
        self._transaction(lambda producer: None, f"noting that step {step} waits")

    def _tasks_ready(self) -> bool:
        """The state's pending tasks hold a step (reading the next block when they are empty). Streaming with
        rounds in flight, an empty topic is not waited on: their results must be collected meanwhile."""
        if not self.state.pending:
            self._read_block(wait=not (self.window or self.evals))
        if self.state.pending:
            return True
        if self.settings.total_epochs is not None:
            self._tasks_exhausted = True  # the last epoch is rolled out
        return False

    def _publish_step(self, step: int, batch: list[tuple[int, Task]]) -> None:
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
        self.state.waiting = ""
        self.window.append(Outstanding(step, requests, self._results_offsets()))
        evals = self._start_evals(-1) if step == 0 and s.eval_on_start else []

        def produce(producer: RecordProducer) -> None:
            self._produce_requests(producer, requests.values())
            for round_ in evals:
                self._produce_requests(producer, round_.requests.values())

        self._transaction(produce, f"publishing step {step}")
        self.g_step.set(self.state.next_step)
        self.g_in_flight.set(len(self.window))
        logger.info("explorer: step %d published: %d tasks (epoch %d, weights >= v%d; %d step(s) in flight)",
                    step, len(requests), self.state.epoch, min_version, len(self.window))

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

    # 1. tasks -------------------------------------------------------------------------------------------
    def _take_batch(self) -> list[tuple[int, Task]]:
        """The next step's (epoch, task) pairs; a block can span an epoch boundary."""
        if not self.state.pending:
            self._read_block()
        refs = self.state.pending[: self.settings.batch_size]
        self.state.pending = self.state.pending[self.settings.batch_size:]
        return [(ref[0], self._tasks_by_ref.pop(tuple(ref))) for ref in refs]

    def _read_block(self, wait: bool = True) -> None:
        """Fill the state's pending list with the next block of tasks, in the selector's order. Streaming
        (``total_epochs: null``) with ``wait=False``, an empty topic returns at once with no block."""
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
                if not block and not wait or block and time.monotonic() - idle_since > s.idle_wait_s:
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

    # 2. collect -----------------------------------------------------------------------------------------
    def _collect(self, timeout: float) -> None:
        """One poll of ``results``: each goes to the round in flight that asked for it (or is retried)."""
        for item in self.results.poll(max_records=500, timeout=timeout):
            result = item.record
            round_ = next((r for r in (*self.window, *self.evals) if result.request_id in r.requests), None)
            if round_ is None:  # a straggler of a step already finished (over-rollout / timeout)
                logger.debug("explorer: late result %s of step %d ignored", result.request_id, result.step)
            elif not self._retried(round_, result):
                round_.results[result.request_id] = result
        self.sync.poll(0)

    def _retried(self, outstanding: Outstanding, result: RolloutResult) -> bool:
        """A FAILED or TIMEOUT task with retries left (``explorer.max_retries``) is published again under a new
        request id, which replaces the old one in its round (and in the explorer's state, same transaction).
        The failed attempt is kept for the step's metrics. After an explorer restart the rounds in flight know
        their requests by id only: their failures are not retried."""
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
        self._transaction(lambda producer: self._produce_requests(producer, [retry]),
                          f"retrying {first} ({attempts} of {self.settings.max_retries})")
        logger.info("explorer: %s was %s; retry %d of %d as %s", result.request_id, result.status.value,
                    attempts, self.settings.max_retries, retry.request_id)
        return True

    def _deadline_ms(self) -> int | None:
        timeout = self.config.rollout.task_timeout_s
        return int(time.time() * 1000 + timeout * 1000) if timeout else None

    def _results_offsets(self) -> dict[str, int]:
        return {str(p): o for (_, p), o in self.results.positions().items()}

    def _start_results_reader(self) -> None:
        """Read ``results`` from where the oldest round in flight's results begin, or from now."""
        offsets = self.clients.offsets(self.config.topic("results"), "end")
        for (topic, partition) in offsets:
            saved = [int(e["results_offsets"][str(partition)]) for e in self.state.in_flight
                     if str(partition) in e.get("results_offsets", {})]
            if saved:
                offsets[(topic, partition)] = min(saved)
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

    # 3. finish ------------------------------------------------------------------------------------------
    def _finish_ready(self) -> None:
        """Finish the oldest steps that can be, in order, and the eval rounds that are complete."""
        now = time.monotonic()
        while self.window and self._step_finishable(self.window[0], now) and not self.stop.requested:
            self._finish_step(self.window.pop(0))
        for round_ in [r for r in self.evals if not r.missing or now - r.started >= self.settings.step_timeout_s]:
            self.evals.remove(round_)
            self._finish_eval(round_)

    def _step_finishable(self, outstanding: Outstanding, now: float) -> bool:
        """All results in; or over-rollout's minimum reached ``wait_after_min_s`` ago; or timed out."""
        s = self.settings
        if not outstanding.missing or now - outstanding.started >= s.step_timeout_s:
            return True
        if len(outstanding.results) < s.min_results:
            return False
        outstanding.reached_min_at = outstanding.reached_min_at or now
        return now - outstanding.reached_min_at >= s.over_rollout.wait_after_min_s

    def _finish_step(self, outstanding: Outstanding) -> None:
        """Publish the step's metrics and mark it finished (and start an eval round when one is due), in one
        transaction. Results still missing are reported CANCELLED (over-rollout) or TIMEOUT."""
        s = self.settings
        missing = outstanding.missing
        if missing:
            timed_out = time.monotonic() - outstanding.started >= s.step_timeout_s
            status = RolloutStatus.TIMEOUT if timed_out else RolloutStatus.CANCELLED
            logger.info("explorer: step %d finishes with %d of %d results; %d %s", outstanding.step,
                        len(outstanding.results), len(outstanding.requests), len(missing), status.value.lower())
            for rid in missing:
                request = outstanding.requests.get(rid)
                outstanding.results[rid] = RolloutResult(
                    request_id=rid, step=outstanding.step, task_id=request.task.task_id if request else "",
                    status=status, n=0, model_version=self.sync.version, duration_ms=0, worker_id=self.source)
        results = list(outstanding.results.values())
        for result in results:
            self.c_results.labels(result.status.value).inc()
            self.selector.observe(result)
        now = time.monotonic()
        metrics = step_metrics(results, outstanding.step, self.sync.version, len(outstanding.requests))
        metrics.update(retry_metrics(outstanding.attempts))
        metrics["time/step_s"] = now - outstanding.started
        metrics["time/step_interval_s"] = now - self._last_finish  # the pace: steps overlap when several fly
        metrics["explorer/steps_in_flight"] = float(len(self.window) + 1)
        self._last_finish = now
        self.state.finished_step = outstanding.step
        evals = self._start_evals(outstanding.step) if self._eval_due(outstanding.step) else []

        def produce(producer: RecordProducer) -> None:
            if missing:
                producer.produce(self.config.topic("control"), SyncSignal(kind=SyncKind.CANCEL_STEP,
                                                                       version=outstanding.step, source=self.source))
            self.metrics.publish(outstanding.step, metrics)
            for round_ in evals:
                self._produce_requests(producer, round_.requests.values())

        self._transaction(produce, f"finishing step {outstanding.step}")
        self.g_in_flight.set(len(self.window))
        logger.info("explorer: step %d done in %.1fs: reward %.3f, accuracy %.3f, %d ok / %d, weights v%d",
                    outstanding.step, metrics["time/step_s"], metrics.get("rollout/reward_mean", float("nan")),
                    metrics.get("rollout/accuracy", float("nan")), int(metrics["rollout/ok"]),
                    len(outstanding.requests), self.sync.version)

    # 3. eval --------------------------------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:
        interval = self.settings.eval_interval
        return interval is not None and (step + 1) % interval == 0

    def _start_evals(self, step: int) -> list[Outstanding]:
        """An eval round per taskset after step ``step`` (-1: the base model, before training), added to the
        rounds in flight; the caller publishes their requests in its transaction, with the state."""
        label = "base" if step < 0 else f"s{step}"
        rounds = []
        for taskset in self.settings.eval_tasksets:
            requests = {}
            for task in self._eval_tasks(taskset):
                request = RolloutRequest(request_id=f"eval-{taskset.name}-{label}-{task.task_id}", step=max(step, 0),
                                         kind=RolloutKind.EVAL, task=task, repeat_times=taskset.repeat_times,
                                         min_model_version=self.sync.version, deadline_ms=self._deadline_ms())
                requests[request.request_id] = request
            rounds.append(Outstanding(step, requests, self._results_offsets(), eval_taskset=taskset.name))
        self.evals += rounds
        return rounds

    def _finish_eval(self, round_: Outstanding) -> None:
        taskset = next((t for t in self.settings.eval_tasksets if t.name == round_.eval_taskset), None)
        results = list(round_.results.values())
        n = taskset.repeat_times if taskset else max((r.n for r in results), default=1)
        metrics = eval_metrics(round_.eval_taskset, results, n)
        if round_.missing:
            metrics[f"eval/{round_.eval_taskset}/timeout"] = float(len(round_.missing))
        self._transaction(lambda producer: self.metrics.publish(round_.step, metrics),
                          f"publishing eval {round_.eval_taskset}")
        when = "the base model" if round_.step < 0 else f"after step {round_.step}"
        logger.info("explorer: eval %s (%s): %s", round_.eval_taskset, when,
                    ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in metrics.items()))

    # -- helpers ------------------------------------------------------------------------------------------
    def _transaction(self, produce, what: str) -> None:
        """Every transaction of the explorer commits the ``tasks`` offsets, so every one also writes the state
        record that says which of those tasks are pending and which rounds are in flight."""
        def with_state(producer: RecordProducer) -> None:
            produce(producer)
            self._produce_state(producer)

        self.runtime.transaction(with_state, what)

    def _produce_requests(self, producer: RecordProducer, requests) -> None:
        """Round-robin over the partitions (rather than by key hash) so every worker gets an even share."""
        topic = self.config.topic("rollouts")
        for request in requests:
            producer.produce(topic, request, partition=self._next_partition % self._rollout_partitions)
            self._next_partition += 1

    def _produce_state(self, producer: RecordProducer) -> None:
        self.state.in_flight = [round_.entry() for round_ in (*self.window, *self.evals)]
        producer.produce(self.config.topic("control"), SyncSignal(
            kind=SyncKind.EXPLORER_STATE, version=self.state.next_step, source=self.source,
            state=self.state.to_json()))

    def _mark_done(self) -> None:
        self.state.done = True
        self.state.waiting = ""
        self._transaction(lambda producer: None, "marking the run done")
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
