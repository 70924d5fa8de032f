"""The explorer role: decides what to roll out and when.

Each pass of the role loop (``RoleRuntime.run``: ``handle``, then the unit's commit), read as numbered steps:
1. while the window has room (``explorer.max_inflight_steps``) and pacing allows the next step (the staleness
   bound and the trainer's backlog, :class:`~streamrft.pacing.Pacing`): take ``batch_size`` tasks from the task
   source and publish the step — a RolloutRequest per task;
2. collect ``results`` for every step and eval round in flight, publishing again the failed tasks that have
   retries left;
3. publish more tasks for the steps that dynamic sampling fills (``dynamic_sampling.py``); finish the oldest
   steps that can be (over-rollout may finish one early and cancel its stragglers; ``step_timeout_s`` reports the
   rest TIMEOUT), in order, with their metrics, and every ``eval_interval`` steps start an eval round; publish
   the metrics of the eval rounds that are complete.

All of one pass is ONE transaction with the explorer's state record on ``control`` and the ``tasks`` offsets:
every transaction of the explorer commits those offsets, so every one also writes the record that says which of
those tasks are pending and which rounds are in flight (the record and the offsets always agree). The explorer's
whole state lives in topics: that record (compacted; it references tasks by partition and offset and rounds by
request id, never embeds them) and the committed ``tasks`` offsets. A restart collects the rounds in flight
from where their results begin. Tasks and results are checked where they are read (``streamrft.validation``);
a bad one goes to its DLQ once and the explorer goes on. The explorer also owns the dead letters of ``sync``
and ``control``.
"""
from __future__ import annotations

import collections
import logging
import time


from streamrft.config import RunConfig
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.metric_catalog import prometheus_metric
from streamrft.pacing import Pacing
from streamrft.rollout_stats import retry_metrics, step_metrics, taskset_metrics
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.schemas import RolloutResult, RolloutStatus, SyncKind, SyncSignal, Task
from streamrft.explorer_state import ExplorerState

from .dynamic_sampling import DynamicSampling
from .evals import EvalRounds
from .retries import Retries
from .rounds import Round, Window, round_of, train_requests
from .resume import replay_results, results_start
from .schedule import TaskSchedule, configured_tasksets

logger = logging.getLogger(__name__)

POLL_S = 0.5


class Explorer:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, source: str = "explorer"):
        self.config = config
        self.settings = config.explorer
        self.clients = clients
        self.stop = stop
        self.source = source
        self.pacing = Pacing.of(config)
        self.runtime = RoleRuntime(config, clients, stop, role="explorer", source=source,
                                   transactional_id=f"{config.name}.explorer", owns_sync_dead_letters=True)
        self.sync = self.runtime.sync
        task_topics = [config.topic_prefix + t.topic_suffix for t in configured_tasksets(config) if t.topic_suffix]
        tasks = self.runtime.consumer("tasks", config.consumer_group("explorer"), client_id=source,
                                      topics=task_topics or None,
                                      check_options={"max_bytes": config.limits.max_task_bytes},
                                      extra={"enable.partition.eof": True})
        self.runtime.bind(tasks)
        self._tasks_consumer = tasks  # the tasksets' one bound consumer, which rejoin() joins again
        self.results = self.runtime.consumer("results", config.consumer_group("explorer"),
                                             client_id=f"{source}-results", subscribe=False)
        self.state = ExplorerState()  # restored from control at start
        self.tasks = TaskSchedule.build(config, clients, tasks, stop, source)  # the tasksets and their mix
        self.window = Window(self.settings)  # training steps in flight, oldest first
        self.evals = EvalRounds(self.settings)  # eval rounds in flight
        self.retries = Retries(self.settings.max_retries)
        self.sampling = DynamicSampling(self.settings)
        self._last_finish = time.monotonic()
        self._noted: tuple[int, str] | None = None  # (step, cause) the explorer last said it waits for
        self._rollout_partitions = len(clients.offsets(config.topic("rollouts")))
        self._next_partition = 0
        registry = self.runtime.registry
        self.g_step = prometheus_metric("streamrft_explorer_step", registry)
        self.g_version = prometheus_metric("streamrft_explorer_model_version", registry)
        self.g_waiting = prometheus_metric("streamrft_explorer_waiting", registry)
        self.g_in_flight = prometheus_metric("streamrft_explorer_steps_in_flight", registry)
        self.c_results = prometheus_metric("streamrft_explorer_results", registry)
        self.runtime.serve(self.settings.metrics_port)

    @property
    def endpoint(self):
        return self.runtime.endpoint

    # -- the loop (RoleRuntime.run: poll -> handle -> commit) ----------------------------------------------
    def run(self) -> ExplorerState:
        self.runtime.run(self, self.runtime.unit_of_work(state=self._state_record))
        return self.state

    def start(self, unit: UnitOfWork) -> None:
        self.sync.catch_up()
        self._restore(self.sync.explorer)

    def rejoin(self, unit: UnitOfWork) -> None:
        """A unit could not commit (the group let the explorer go, or the brokers were away): nothing of it is
        visible, so the explorer goes on exactly as a restart would, from its last committed state record and the
        ``tasks`` offsets committed with it: the tasks it read since are read again, the steps it published since
        are published again under the same request ids."""
        unit.discard()
        self._tasks_consumer.rejoin()
        self.tasks = TaskSchedule.build(self.config, self.clients, self._tasks_consumer, self.stop, self.source)
        self.window = Window(self.settings)
        self.evals = EvalRounds(self.settings)
        self.retries = Retries(self.settings.max_retries)
        self._noted = None
        self._restore(ExplorerState.from_json(self._committed_state))

    def _restore(self, state: ExplorerState) -> None:
        """Take over a committed state record, as at start: the tasksets' positions, the rounds in flight and
        where their results begin."""
        self.state = state
        self._committed_state = self._staged_state = state.to_json()
        self.tasks.restore(state.tasksets, blocks_before=state.next_step // self.settings.selector.block_steps)
        self.window.restore(state.in_flight)
        self.evals.restore(state.in_flight)
        self.results.assign(results_start(self.config, self.clients, state.in_flight))
        if self.tasks.learns:
            replay_results(self.config, self.clients, self.tasks)
        if state.done:
            logger.info("explorer: the run is already complete (step %d); nothing to do", state.next_step)
            return
        if state.in_flight:
            logger.info("explorer: resuming; collecting step(s) %s and %d eval round(s) in flight",
                        state.steps_in_flight, len(self.evals))
        logger.info("explorer: starting at step %d, epoch %d, up to %d step(s) in flight", state.next_step,
                    state.epoch, self.settings.max_inflight_steps)
        if not self.pacing.paced:
            logger.info("explorer: %s (max_buffered_batches does not apply; requests take whatever weights the "
                        "workers serve)", self.pacing.describe())
        self._last_finish = time.monotonic()

    def handle(self, unit: UnitOfWork) -> bool:
        self._committed_state = self._staged_state  # a pass begins once the last one's unit is committed
        if self.state.done:
            return False
        while not self.stop.requested and self._publish_next_step(unit):  # 1.
            pass
        for refused in self.tasks.take_refused():  # read past with this unit's offsets (tasks.py)
            unit.dead_letter(refused.letter(self.config.consumer_group("explorer")))
        if self._publishing_over and not self.window and not self.evals:
            return False
        # no waiting for results while this pass holds uncommitted work: the requests' deadlines already run
        self._collect(unit, timeout=0 if unit.due else POLL_S / 2)  # 2.
        self._finish_ready(unit)  # 3.
        return True

    def finish(self, unit: UnitOfWork) -> None:
        if self.stop.requested or self.state.done:
            return
        self.state.done = True
        self.state.waiting = ""
        unit.touch()
        unit.describe("marking the run done")
        unit.after_commit(lambda: logger.info("explorer: done after %d steps", self.state.next_step))

    # 1. pacing and publishing -----------------------------------------------------------------------------
    def _publish_next_step(self, unit: UnitOfWork) -> bool:
        """Publish the next step if the window has room, there are tasks and pacing allows it."""
        if self._publishing_over or not self.window.has_room:
            return False
        step = self.state.next_step
        if not self.tasks.ready(wait=not (self.window or self.evals)):
            return False
        self.g_version.set(self.sync.version)
        hold = self.pacing.hold(step, self.sync, self._trainer_lag)
        self.g_waiting.set(1 if hold else 0)
        if hold:
            self._note_waiting(unit, step, hold.cause, hold.waits_for)
            return False
        self._publish_step(unit, step, self.tasks.take(step))
        return True

    @property
    def _publishing_over(self) -> bool:
        max_steps = self.settings.max_steps
        return self.tasks.exhausted or (max_steps is not None and self.state.next_step >= max_steps)

    def _trainer_lag(self) -> int | None:
        return self.clients.lag(self.config.consumer_group("trainer"), self.config.topic("experiences"))

    def _note_waiting(self, unit: UnitOfWork, step: int, cause: str, waits_for: str) -> None:
        """Say once per step and cause what the explorer waits for: in the log, and in the state record for
        the dashboard (every commit writes the state)."""
        if self._noted == (step, cause):
            return
        self._noted = (step, cause)
        self.state.waiting = waits_for
        logger.info("explorer: step %d waits for %s (in flight: %s)", step, waits_for, self.window.steps or "none")
        unit.touch()
        unit.describe(f"noting that step {step} waits")

    def _publish_step(self, unit: UnitOfWork, step: int, batch: list[tuple[int, Task]]) -> None:
        s = self.settings
        min_version = self.pacing.min_model_version(step, self.sync)
        requests = train_requests(step, batch, s.repeat_times, min_version, self._deadline_ms())
        self.state.next_step = step + 1
        self.state.waiting = ""
        self.window.add(Round(step, requests, self._results_offsets()))
        self._publish_requests(unit, requests.values())
        if step == 0 and s.eval_on_start:
            self._start_evals(unit, -1)
        unit.describe(f"publishing step {step}")
        self.g_step.set(self.state.next_step)
        self.g_in_flight.set(len(self.window))
        mix = ", ".join(f"{n} {name}" for name, n in
                        collections.Counter(r.task.taskset for r in requests.values()).items())
        epoch, in_flight = max((e for e, _ in batch), default=0), len(self.window)
        unit.after_commit(lambda: logger.info(
            "explorer: step %d published: %d tasks (%s; epoch %d, weights >= v%d; %d step(s) in flight)",
            step, len(requests), mix, epoch, min_version, in_flight))

    def _publish_requests(self, unit: UnitOfWork, requests) -> None:
        """Round-robin over the partitions (rather than by key hash) so every worker gets an even share."""
        topic = self.config.topic("rollouts")
        for request in requests:
            unit.produce(topic, request, partition=self._next_partition % self._rollout_partitions)
            self._next_partition += 1

    def _deadline_ms(self) -> int | None:
        timeout = self.config.rollout.task_timeout_s
        return int(time.time() * 1000 + timeout * 1000) if timeout else None

    # 2. collect -----------------------------------------------------------------------------------------
    def _collect(self, unit: UnitOfWork, timeout: float) -> None:
        """One poll of ``results``: each goes to the round in flight that asked for it (or is retried)."""
        for item in self.results.poll(max_records=500, timeout=timeout):
            result = item.record
            round_ = round_of((*self.window, *self.evals), result.request_id)
            if round_ is None:  # a straggler of a step already finished (over-rollout / timeout)
                logger.debug("explorer: late result %s of step %d ignored", result.request_id, result.step)
                continue
            retry = self.retries.retry(round_, result, self._deadline_ms())
            if retry is None:
                round_.results[result.request_id] = result
                continue
            self._publish_requests(unit, [retry])
            attempts = round_.retries[round_.first_attempt[retry.request_id]]
            unit.describe(f"retrying {result.request_id} ({attempts} of {self.retries.max_retries})")
            logger.info("explorer: %s was %s; retry %d of %d as %s", result.request_id, result.status.value,
                        attempts, self.retries.max_retries, retry.request_id)

    def _results_offsets(self) -> dict[str, int]:
        return {str(p): o for (_, p), o in self.results.positions().items()}

    # 3. finish ------------------------------------------------------------------------------------------
    def _finish_ready(self, unit: UnitOfWork) -> None:
        """Roll out more tasks for the steps dynamic sampling fills; finish the oldest steps that can be, in order,
        and the eval rounds that are complete."""
        now = time.monotonic()
        for round_ in self.window:
            if not self.window.timed_out(round_, now) and (more := self.sampling.top_up(
                    round_, self.tasks, self.pacing.min_model_version(round_.step, self.sync), self._deadline_ms())):
                self._publish_requests(unit, more)
                unit.describe(f"rolling out {len(more)} more task(s) for step {round_.step}")
        while not self.stop.requested and (round_ := self.window.pop_finishable(now)) is not None:
            self._finish_step(unit, round_, timed_out=self.window.timed_out(round_, now))
        for round_ in self.evals.complete(now):
            self._finish_eval(unit, round_)

    def _finish_step(self, unit: UnitOfWork, round_: Round, timed_out: bool) -> None:
        """The step's metrics, the step marked finished (and an eval round when one is due); results still
        missing are reported CANCELLED (over-rollout) or TIMEOUT."""
        missing = round_.missing
        if missing:
            status = RolloutStatus.TIMEOUT if timed_out else RolloutStatus.CANCELLED
            logger.info("explorer: step %d finishes with %d of %d results; %d %s", round_.step,
                        len(round_.results), len(round_.requests), len(missing), status.value.lower())
            for rid in missing:
                request = round_.requests.get(rid)
                round_.results[rid] = RolloutResult(
                    request_id=rid, step=round_.step, task_id=request.task.task_id if request else "",
                    status=status, n=0, model_version=self.sync.version, duration_ms=0, worker_id=self.source,
                    taskset=request.task.taskset if request else "")
            unit.produce(self.config.topic("control"), SyncSignal(kind=SyncKind.CANCEL_STEP, step=round_.step,
                                                                   source=self.source))
        results = list(round_.results.values())
        for result in results:
            self.c_results.labels(result.status.value).inc()
            self.tasks.observe(result)
        now = time.monotonic()
        metrics = step_metrics(results, round_.step, self.sync.version, len(round_.requests))
        if self.settings.tasksets:
            metrics.update(self._taskset_metrics(results))
        metrics.update(retry_metrics(round_.attempts))
        metrics.update(self.sampling.metrics(round_))
        metrics["time/step_s"] = now - round_.started
        metrics["time/step_interval_s"] = now - self._last_finish  # the pace: steps overlap when several fly
        metrics["explorer/steps_in_flight"] = float(len(self.window) + 1)
        self._last_finish = now
        self.state.finished_step = round_.step
        unit.metrics(round_.step, metrics)
        if self.evals.due(round_.step):
            self._start_evals(unit, round_.step)
        unit.describe(f"finishing step {round_.step}")
        self.g_in_flight.set(len(self.window))
        version = self.sync.version
        unit.after_commit(lambda: logger.info(
            "explorer: step %d done in %.1fs: reward %.3f, accuracy %.3f, %d ok / %d, weights v%d", round_.step,
            metrics["time/step_s"], metrics.get("rollout/reward_mean", float("nan")),
            metrics.get("rollout/accuracy", float("nan")), int(metrics["rollout/ok"]), len(round_.requests),
            version))

    def _taskset_metrics(self, results: list[RolloutResult]) -> dict[str, float]:
        """``rollout/taskset/<name>/*`` of the step, and the solved tasks each taskset has passed over."""
        metrics = taskset_metrics(results, [t.name for t in self.tasks.tasksets])
        for taskset in self.tasks.tasksets:
            metrics[f"explorer/taskset/{taskset.name}/skipped_solved"] = float(taskset.skipped)
        return metrics

    def _start_evals(self, unit: UnitOfWork, step: int) -> None:
        rounds = self.evals.start(step, self.sync.version, self._deadline_ms(), self._results_offsets())
        for round_ in rounds:
            self._publish_requests(unit, round_.requests.values())

    def _finish_eval(self, unit: UnitOfWork, round_: Round) -> None:
        metrics = self.evals.metrics(round_)
        unit.metrics(round_.step, metrics)
        unit.describe(f"publishing eval {round_.eval_taskset}")
        when = "the base model" if round_.step < 0 else f"after step {round_.step}"
        unit.after_commit(lambda: logger.info("explorer: eval %s (%s): %s", round_.eval_taskset, when, ", ".join(
            f"{k.split('/')[-1]}={v:.3f}" for k, v in metrics.items())))

    # -- the state record, written with every commit ------------------------------------------------------
    def _state_record(self) -> list[tuple[str, SyncSignal]]:
        self.state.in_flight = [round_.entry() for round_ in (*self.window, *self.evals)]
        self.state.tasksets = self.tasks.positions()
        self.state.epoch = next(iter(self.state.tasksets.values()))["epoch"]
        self._staged_state = self.state.to_json()  # the committed one once the unit commits (rejoin)
        return [(self.config.topic("control"), SyncSignal(
            kind=SyncKind.EXPLORER_STATE, step=self.state.next_step, source=self.source,
            state=self._staged_state))]

    def close(self) -> None:
        self.runtime.close()
