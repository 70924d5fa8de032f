"""Eval rounds (``explorer.eval_interval``, ``eval_on_start``): one round per eval taskset after every
``eval_interval`` training steps (and one before training, at step -1), whose requests are kind EVAL (results and
metrics, no training experiences). They run beside the training steps in flight, are published in the
transaction that finishes their step, and report ``eval/<taskset>/...`` once complete (or after
``step_timeout_s``, the missing ones counted)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from streamrft.config import EvalTaskset, ExplorerConfig
from streamrft.producers.task_files import FieldMapping, read_tasks
from streamrft.rollout_stats import eval_metrics
from streamrft.schemas import RolloutKind, RolloutRequest, Task

from .rounds import Round


def load_eval_tasks(taskset: EvalTaskset) -> list[Task]:
    mapping = FieldMapping.from_task_file(taskset)
    tasks = [t for t in read_tasks(taskset.path, mapping) if isinstance(t, Task)]
    return tasks[: taskset.max_tasks] if taskset.max_tasks else tasks


class EvalRounds:
    def __init__(self, settings: ExplorerConfig) -> None:
        self.settings = settings
        self.rounds: list[Round] = []
        self._tasks: dict[str, list[Task]] = {}  # taskset name -> its tasks (files read once)

    def due(self, step: int) -> bool:
        interval = self.settings.eval_interval
        return interval is not None and (step + 1) % interval == 0

    def start(self, step: int, min_model_version: int, deadline_ms: int | None,
              results_offsets: dict[str, int]) -> list[Round]:
        """An eval round per taskset after step ``step`` (-1: the base model, before training), added to the
        rounds in flight; the caller publishes their requests in its transaction, with the state."""
        label = "base" if step < 0 else f"s{step}"
        rounds = []
        for taskset in self.settings.eval_tasksets:
            requests = {}
            for task in self._tasks_of(taskset):
                request = RolloutRequest(request_id=f"eval-{taskset.name}-{label}-{task.task_id}", step=max(step, 0),
                                         kind=RolloutKind.EVAL, task=task, repeat_times=taskset.repeat_times,
                                         min_model_version=min_model_version, deadline_ms=deadline_ms)
                requests[request.request_id] = request
            rounds.append(Round(step, requests, dict(results_offsets), eval_taskset=taskset.name))
        self.rounds += rounds
        return rounds

    def restore(self, entries: Iterable[dict]) -> None:
        self.rounds = [Round.of(entry) for entry in entries if "eval" in entry]

    def complete(self, now: float) -> list[Round]:
        """Take the rounds whose results are all in, or that timed out."""
        done = [r for r in self.rounds if not r.missing or now - r.started >= self.settings.step_timeout_s]
        self.rounds = [r for r in self.rounds if r not in done]
        return done

    def metrics(self, round_: Round) -> dict[str, float]:
        taskset = next((t for t in self.settings.eval_tasksets if t.name == round_.eval_taskset), None)
        results = list(round_.results.values())
        n = taskset.repeat_times if taskset else max((r.n for r in results), default=1)
        metrics = eval_metrics(round_.eval_taskset, results, n)
        if round_.missing:
            metrics[f"eval/{round_.eval_taskset}/timeout"] = float(len(round_.missing))
        return metrics

    def _tasks_of(self, taskset: EvalTaskset) -> list[Task]:
        """An eval set's tasks, read from its file at the first eval round only."""
        if taskset.name not in self._tasks:
            self._tasks[taskset.name] = load_eval_tasks(taskset)
        return self._tasks[taskset.name]

    def __len__(self) -> int:
        return len(self.rounds)

    def __iter__(self) -> Iterator[Round]:
        return iter(self.rounds)
