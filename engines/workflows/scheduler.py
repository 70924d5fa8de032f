"""Workflows running side by side on one engine -- and on the auxiliary models beside it -- every engine driven
from one thread (continuous batching).

Workflows are plain synchronous code: a turn calls ``engine.generate`` and waits. Each workflow of a
:class:`WorkflowPool` runs in its own thread against a :class:`SharedEngine`, whose ``generate`` hands the
call to the pool's owner and waits for its result. The owner's thread calls :meth:`WorkflowPool.drive`, which
submits the waiting calls to the real engine and steps it, so the engine is used from that thread alone:

- an **incremental** engine (vLLM) is stepped whenever it has work: a call submitted while others run joins the
  running batch at the next step, and comes back as soon as its own samples are done;
- a **batch** engine (transformers: one step runs every submitted call to its end) is stepped once every running
  workflow is waiting on a call, so all of them share one batch; workflows started meanwhile join the next.

**Auxiliary models** (a judge, a teacher: :mod:`.auxiliary`) are more lanes of the same driver: a judge's
``generate`` and a teacher's scoring calls queue on their own lane and are stepped by the same owner thread, by
the same rules (a lane of a batch engine steps once every live workflow waits on *some* lane, so the judge calls
of every workflow that is judging go in one batch). One thread drives every engine of a worker, so they take
turns on the device rather than compete for its cores or its memory bandwidth, and an engine is never called
from two threads.

Calls are checked against ``limits`` in the caller's thread (an over-long prompt fails its own workflow only), and
the engine hands a failing call's exception to that call alone. Because engines seed samples per row, a
workflow's samples do not depend on what it was batched with.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamrft.schemas import Task

from ..inference.base import Completion, EngineError, Finished, InferenceEngine, SamplingParams, per_prompt_params
from .auxiliary import AuxiliaryModels, Teacher, WorkflowContext
from .base import WorkflowError, WorkflowSample
from .build import run_workflow
from ..settings.limits import WorkLimits
from .teacher import scorer_for

# what a finished workflow hands back: its samples, or the error it failed with
Outcome = list[WorkflowSample] | WorkflowError


class Cancelled(EngineError):
    """The pool's owner dropped this workflow (its request is no longer this worker's); it stops at its next
    engine call."""


class Backend(Protocol):
    """What a lane drives: an InferenceEngine (``submit(key, prompts, params, n)``) or a teacher's scorer
    (``submit(key, sequences, prompt_lengths, temperature)``)."""

    incremental: bool

    def submit(self, key: Hashable, *args: Any) -> None: ...

    def step(self) -> list[Finished]: ...

    def abort(self, keys: Sequence[Hashable]) -> None: ...


@dataclass(slots=True)
class _Waiting:
    workflow: Hashable
    args: tuple  # what the lane's backend.submit takes after the key
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class _Lane:
    """One backend and its calls: those not yet handed to it, and those it has (the owner's thread alone
    touches ``running``)."""

    def __init__(self, name: str, backend: Backend) -> None:
        self.name = name
        self.backend = backend
        self.queued: list[_Waiting] = []
        self.running: dict[int, _Waiting] = {}
        self.calls_per_step: list[int] = []  # calls handed to the backend before each step (batch sizes)

    @property
    def waiting(self) -> int:
        """Workflows blocked on this lane (each waits on one call at a time)."""
        return len(self.queued) + len(self.running)


class Driver:
    """The lanes one owner thread steps, the workflows that call them, and which of those were cancelled."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._local = threading.local()
        self.lanes: list[_Lane] = []
        self.cancelled: set[Hashable] = set()
        self.live = 0  # workflows started and not finished

    def lane(self, name: str, backend: Backend) -> _Lane:
        lane = _Lane(name, backend)
        self.lanes.append(lane)
        return lane

    # -- the workflow threads' side ------------------------------------------------------------------------
    def call(self, lane: _Lane, *args: Any) -> Any:
        """Queue a call on ``lane`` and wait for its result (raising what the backend raised for it)."""
        workflow = getattr(self._local, "workflow", None)
        waiting = _Waiting(workflow, args)
        with self._cond:
            if workflow in self.cancelled:
                raise Cancelled(f"workflow {workflow!r} was cancelled")
            lane.queued.append(waiting)
            self._cond.notify_all()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return waiting.result

    def run_as(self, workflow: Hashable) -> None:
        """Name the calling thread's workflow (for cancelling)."""
        self._local.workflow = workflow

    def started(self) -> None:
        with self._cond:
            self.live += 1

    def finished(self) -> None:
        with self._cond:
            self.live -= 1
            self._cond.notify_all()

    # -- the owner's side ------------------------------------------------------------------------------------
    def drive(self, timeout: float) -> None:
        """Step each lane that is ready once (see the module docstring); with none ready, wait up to ``timeout``
        for a call or a workflow's end."""
        with self._cond:
            ready = self._ready()
            if not ready:
                self._cond.wait(timeout)
                ready = self._ready()
        for lane in ready:  # a lane that raises leaves the others' calls queued for the next drive
            with self._cond:
                queued, lane.queued = lane.queued, []
            self._step(lane, queued)

    def _ready(self) -> list[_Lane]:
        blocked = sum(lane.waiting for lane in self.lanes)
        return [lane for lane in self.lanes
                if (lane.waiting if lane.backend.incremental else lane.queued and blocked >= self.live)]

    def _step(self, lane: _Lane, queued: list[_Waiting]) -> None:
        for waiting in queued:
            key = next(self._ids)
            lane.running[key] = waiting
            lane.backend.submit(key, *waiting.args)
        lane.calls_per_step.append(len(queued))
        try:
            finished = lane.backend.step()
        except BaseException as exc:  # the backend itself broke: no call waits for ever, then the owner hears
            for waiting in lane.running.values():
                waiting.error = exc
                waiting.done.set()
            lane.running.clear()
            raise
        for key, result in finished:
            waiting = lane.running.pop(key)
            if isinstance(result, BaseException):
                waiting.error = result
            else:
                waiting.result = result
            waiting.done.set()

    def cancel(self, workflows: set[Hashable]) -> None:
        """Fail the calls of these workflows now (and any call they make later) with :class:`Cancelled`."""
        with self._cond:
            self.cancelled |= workflows
            dropped = [w for lane in self.lanes for w in lane.queued if w.workflow in workflows]
            for lane in self.lanes:
                lane.queued = [w for w in lane.queued if w.workflow not in workflows]
        for lane in self.lanes:
            running = {key: w for key, w in lane.running.items() if w.workflow in workflows}
            lane.backend.abort(list(running))
            for key in running:
                del lane.running[key]
            dropped += running.values()
        for waiting in dropped:
            waiting.error = Cancelled(f"workflow {waiting.workflow!r} was cancelled")
            waiting.done.set()


class SharedEngine(InferenceEngine):
    """An engine as workflow threads see it: ``generate`` queues the call on the engine's lane of the pool's
    :class:`Driver` and waits (see the module docstring). Not for loading weights: the owner loads them on the
    real engine while no workflow runs."""

    def __init__(self, driver: Driver, engine: InferenceEngine, limits: WorkLimits, name: str = "policy") -> None:
        self.driver = driver
        self.engine = engine
        self.limits = limits
        self.tokenizer = engine.tokenizer
        self.kind = engine.kind
        self.max_model_len = engine.max_model_len
        self._lane = driver.lane(name, engine)

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def calls_per_step(self) -> list[int]:
        """Calls handed to the engine before each of its steps (its batch sizes)."""
        return self._lane.calls_per_step

    def generate(self, prompts, params, n: int = 1) -> list[list[Completion]]:
        for prompt in prompts:
            self.limits.check_prompt(len(self.engine.prompt_ids(prompt)))
        return self.driver.call(self._lane, list(prompts), per_prompt_params(params, len(prompts)), n)

    def load_weights(self, weights, version: int) -> None:
        raise RuntimeError("load weights on the engine itself, while no workflow runs")

    def state_dict(self):
        return self.engine.state_dict()


class WorkflowPool:
    """Workflows by key, each in its own thread, on one :class:`SharedEngine` (and the auxiliary models of
    :meth:`attach`) that :meth:`drive` steps."""

    def __init__(self, engine: InferenceEngine, limits: WorkLimits | None = None) -> None:
        self.driver = Driver()
        self.shared = SharedEngine(self.driver, engine, limits or WorkLimits())
        self.context = WorkflowContext()
        self._lock = threading.Lock()
        self._threads: dict[Hashable, threading.Thread] = {}
        self._finished: list[tuple[Hashable, Outcome]] = []

    def attach(self, auxiliary: Mapping[str, InferenceEngine], *, judge: Any = None,
               teacher: str | None = None) -> WorkflowContext:
        """Give the workflows started from now on the run's auxiliary models by name (each on a lane of its own
        that this pool's owner drives), the judge reward's settings (``judge.JudgeSettings``; None: the
        defaults) and the teacher (one of ``auxiliary``) whose logprobs of every sample's tokens are stored with
        it. Call it once, before the first workflow starts; returns the context the workflows get."""
        if self._threads:
            raise RuntimeError("attach auxiliary models before the first workflow starts")
        limits = self.shared.limits
        views = {name: SharedEngine(self.driver, engine, limits, name=name) for name, engine in auxiliary.items()}
        models = AuxiliaryModels(views)
        scoring = None
        if teacher is not None:
            models.engine(teacher, wanted_by="distillation.teacher")  # refused here, at the worker's start
            engine = auxiliary[teacher]
            lane = self.driver.lane(f"{teacher}/logprobs", scorer_for(engine))
            scoring = Teacher(teacher, engine.tokenizer, lambda *args: self.driver.call(lane, *args))
        self.context = WorkflowContext.of(models, judge=judge, teacher=scoring)
        return self.context

    @property
    def running(self) -> int:
        return len(self._threads)

    def start(self, key: Hashable, task: Task, repeat_times: int | None, sampling: SamplingParams,
              greedy_baseline: bool = False) -> None:
        """Run ``task``'s workflow under ``key`` (unique among running workflows); ``greedy_baseline``: with
        ReMax's greedy sample (:mod:`.greedy`)."""
        if key in self._threads:
            raise ValueError(f"workflow {key!r} is already running")
        self.driver.started()

        def run() -> None:
            self.driver.run_as(key)
            try:
                outcome: Outcome = run_workflow(task, self.shared, repeat_times, sampling, self.shared.limits,
                                                self.context, greedy_baseline)
            except WorkflowError as exc:
                outcome = exc
            with self._lock:
                self._finished.append((key, outcome))
            self.driver.finished()

        thread = threading.Thread(target=run, name=f"workflow-{key}", daemon=True)
        self._threads[key] = thread
        thread.start()

    def drive(self, timeout: float = 0.1) -> list[tuple[Hashable, Outcome]]:
        """Step the engines once (or wait up to ``timeout`` for work) and hand back the workflows that finished,
        in the order they finished. Cancelled workflows are not handed back."""
        self.driver.drive(timeout)
        with self._lock:
            finished, self._finished = self._finished, []
        out = []
        for key, outcome in finished:
            self._threads.pop(key).join()
            if key in self.driver.cancelled:
                self.driver.cancelled.discard(key)
            else:
                out.append((key, outcome))
        return out

    def cancel(self, keys: set[Hashable]) -> None:
        """Stop these workflows at their next engine call; their outcomes are dropped."""
        self.driver.cancel(set(keys) & set(self._threads))

    def close(self) -> None:
        """Cancel every running workflow and wait for their threads."""
        self.cancel(set(self._threads))
        for thread in list(self._threads.values()):
            thread.join(timeout=10)
        self._threads.clear()


def run_workflows(
    tasks: Sequence[Task],
    engine: InferenceEngine,
    repeat_times: int | Sequence[int | None] | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    limits: WorkLimits | None = None,
    auxiliary: Mapping[str, InferenceEngine] | None = None,
    *,
    judge: Any = None,
    teacher: str | None = None,
) -> list[Outcome]:
    """:func:`run_workflow` for each task, side by side on one engine (and ``auxiliary`` models, see
    :meth:`WorkflowPool.attach`). Returns, per task, its samples or the :class:`WorkflowError` it failed with (one
    failing task does not fail the others)."""
    repeats = list(repeat_times) if isinstance(repeat_times, Sequence) else [repeat_times] * len(tasks)
    if len(repeats) != len(tasks):
        raise ValueError(f"{len(repeats)} repeat_times for {len(tasks)} tasks")
    samplings = per_prompt_params(sampling or SamplingParams(), len(tasks))
    pool = WorkflowPool(engine, limits)
    if auxiliary or teacher:
        pool.attach(auxiliary or {}, judge=judge, teacher=teacher)
    for i, task in enumerate(tasks):
        pool.start(i, task, repeats[i], samplings[i])
    outcomes: dict[Hashable, Outcome] = {}
    try:
        while len(outcomes) < len(tasks):
            outcomes.update(pool.drive(timeout=1.0))
    finally:
        pool.close()
    return [outcomes[i] for i in range(len(tasks))]
