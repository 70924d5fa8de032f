"""Workflows running side by side on one engine, the engine driven from one thread (continuous batching).

Workflows are plain synchronous code: a turn calls ``engine.generate`` and waits. Each workflow of a
:class:`WorkflowPool` runs in its own thread against a :class:`SharedEngine`, whose ``generate`` hands the
call to the pool's owner and waits for its result. The owner's thread calls :meth:`WorkflowPool.drive`, which
submits the waiting calls to the real engine and steps it, so the engine is used from that thread alone:

- an **incremental** engine (vLLM) is stepped whenever it has work: a call submitted while others run joins the
  running batch at the next step, and comes back as soon as its own samples are done;
- a **batch** engine (transformers: one step runs every submitted call to its end) is stepped once every running
  workflow is waiting on a call, so all of them share one batch; workflows started meanwhile join the next.

Calls are checked against ``limits`` in the caller's thread (an over-long prompt fails its own workflow only), and
the engine hands a failing call's exception to that call alone. Because engines seed samples per row, a
workflow's samples do not depend on what it was batched with.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from streamrft.schemas import Task

from ..inference.base import Completion, EngineError, InferenceEngine, Prompt, SamplingParams, per_prompt_params
from .base import WorkflowError, WorkflowSample, run_workflow
from .limits import WorkLimits

# what a finished workflow hands back: its samples, or the error it failed with
Outcome = list[WorkflowSample] | WorkflowError


class Cancelled(EngineError):
    """The pool's owner dropped this workflow (its request is no longer this worker's); it stops at its next
    engine call."""


@dataclass(slots=True)
class _Waiting:
    workflow: Hashable
    prompts: list[Prompt]
    params: SamplingParams | Sequence[SamplingParams]
    n: int
    done: threading.Event = field(default_factory=threading.Event)
    result: list[list[Completion]] | None = None
    error: BaseException | None = None


class SharedEngine(InferenceEngine):
    """The engine as workflow threads see it (see the module docstring). Not for loading weights: the owner
    loads them on the real engine while no workflow runs."""

    def __init__(self, engine: InferenceEngine, limits: WorkLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.tokenizer = engine.tokenizer
        self.kind = engine.kind
        self.max_model_len = engine.max_model_len
        self._cond = threading.Condition()
        self._queued: list[_Waiting] = []  # calls not yet handed to the engine
        self._running: dict[int, _Waiting] = {}  # id -> calls the engine has
        self._ids = itertools.count()
        self._local = threading.local()
        self.cancelled: set[Hashable] = set()
        self.live = 0  # workflows started and not finished
        self.calls_per_step: list[int] = []  # calls handed to the engine before each step (batch sizes)

    @property
    def version(self) -> int:
        return self.engine.version

    # -- the workflow threads' side ------------------------------------------------------------------------
    def generate(self, prompts, params, n: int = 1) -> list[list[Completion]]:
        for prompt in prompts:
            self.limits.check_prompt(len(self.engine.prompt_ids(prompt)))
        workflow = getattr(self._local, "workflow", None)
        waiting = _Waiting(workflow, list(prompts), params, n)
        with self._cond:
            if workflow in self.cancelled:
                raise Cancelled(f"workflow {workflow!r} was cancelled")
            self._queued.append(waiting)
            self._cond.notify_all()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        assert waiting.result is not None
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
        """Hand the waiting calls to the engine and step it once, when there is something to step (see the
        module docstring); else wait up to ``timeout`` for a call or a workflow's end."""
        with self._cond:
            if not self._ready_to_step():
                self._cond.wait(timeout)
                if not self._ready_to_step():
                    return
            queued, self._queued = self._queued, []
        for waiting in queued:
            key = next(self._ids)
            self._running[key] = waiting
            self.engine.submit(key, waiting.prompts, waiting.params, waiting.n)
        self.calls_per_step.append(len(queued))
        try:
            finished = self.engine.step()
        except BaseException as exc:  # the engine itself broke: no call waits for ever, then the owner hears
            for waiting in self._running.values():
                waiting.error = exc
                waiting.done.set()
            self._running.clear()
            raise
        for key, result in finished:
            waiting = self._running.pop(key)
            if isinstance(result, BaseException):
                waiting.error = result
            else:
                waiting.result = result
            waiting.done.set()

    def _ready_to_step(self) -> bool:
        if self.engine.incremental:
            return bool(self._queued or self._running)
        return bool(self._queued) and len(self._queued) >= self.live

    def cancel(self, workflows: set[Hashable]) -> None:
        """Fail the calls of these workflows now (and any call they make later) with :class:`Cancelled`."""
        with self._cond:
            self.cancelled |= workflows
            dropped = [w for w in self._queued if w.workflow in workflows]
            self._queued = [w for w in self._queued if w.workflow not in workflows]
        running = {key: w for key, w in self._running.items() if w.workflow in workflows}
        self.engine.abort(running)
        for key in running:
            del self._running[key]
        for waiting in [*dropped, *running.values()]:
            waiting.error = Cancelled(f"workflow {waiting.workflow!r} was cancelled")
            waiting.done.set()

    def load_weights(self, weights, version: int) -> None:
        raise RuntimeError("load weights on the engine itself, while no workflow runs")

    def state_dict(self):
        return self.engine.state_dict()


class WorkflowPool:
    """Workflows by key, each in its own thread, on one :class:`SharedEngine` that :meth:`drive` steps."""

    def __init__(self, engine: InferenceEngine, limits: WorkLimits | None = None) -> None:
        self.shared = SharedEngine(engine, limits or WorkLimits())
        self._lock = threading.Lock()
        self._threads: dict[Hashable, threading.Thread] = {}
        self._finished: list[tuple[Hashable, Outcome]] = []

    @property
    def running(self) -> int:
        return len(self._threads)

    def start(self, key: Hashable, task: Task, repeat_times: int | None, sampling: SamplingParams) -> None:
        """Run ``task``'s workflow under ``key`` (unique among running workflows)."""
        if key in self._threads:
            raise ValueError(f"workflow {key!r} is already running")
        self.shared.started()

        def run() -> None:
            self.shared.run_as(key)
            try:
                outcome: Outcome = run_workflow(task, self.shared, repeat_times, sampling, self.shared.limits)
            except WorkflowError as exc:
                outcome = exc
            with self._lock:
                self._finished.append((key, outcome))
            self.shared.finished()

        thread = threading.Thread(target=run, name=f"workflow-{key}", daemon=True)
        self._threads[key] = thread
        thread.start()

    def drive(self, timeout: float = 0.1) -> list[tuple[Hashable, Outcome]]:
        """Step the engine once (or wait up to ``timeout`` for work) and hand back the workflows that finished,
        in the order they finished. Cancelled workflows are not handed back."""
        self.shared.drive(timeout)
        with self._lock:
            finished, self._finished = self._finished, []
        out = []
        for key, outcome in finished:
            self._threads.pop(key).join()
            if key in self.shared.cancelled:
                self.shared.cancelled.discard(key)
            else:
                out.append((key, outcome))
        return out

    def cancel(self, keys: set[Hashable]) -> None:
        """Stop these workflows at their next engine call; their outcomes are dropped."""
        self.shared.cancel(set(keys) & set(self._threads))

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
) -> list[Outcome]:
    """:func:`run_workflow` for each task, side by side on one engine. Returns, per task, its samples or the
    :class:`WorkflowError` it failed with (one failing task does not fail the others)."""
    repeats = list(repeat_times) if isinstance(repeat_times, Sequence) else [repeat_times] * len(tasks)
    if len(repeats) != len(tasks):
        raise ValueError(f"{len(repeats)} repeat_times for {len(tasks)} tasks")
    samplings = per_prompt_params(sampling or SamplingParams(), len(tasks))
    pool = WorkflowPool(engine, limits)
    for i, task in enumerate(tasks):
        pool.start(i, task, repeats[i], samplings[i])
    outcomes: dict[Hashable, Outcome] = {}
    try:
        while len(outcomes) < len(tasks):
            outcomes.update(pool.drive(timeout=1.0))
    finally:
        pool.close()
    return [outcomes[i] for i in range(len(tasks))]
