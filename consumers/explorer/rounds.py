"""The rounds the explorer has in flight: a training step's requests or an eval round's, with the results
collected so far, and the window of training steps, which finish in order."""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from streamrft.config import ExplorerConfig
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, Task


@dataclass
class Round:
    """The requests of one training step (or one eval round) and the results collected."""

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
    oversampled: int = 0  # extra rounds of tasks rolled out for this step (explorer.dynamic_sampling)
    wants_tasks: bool = False  # dynamic sampling waits for more tasks: the step may not finish yet

    @property
    def missing(self) -> list[str]:
        return [rid for rid in self.requests if rid not in self.results]

    def entry(self) -> dict:
        """This round in the state record's ``in_flight``."""
        entry = {"step": self.step, "requests": list(self.requests), "results_offsets": self.results_offsets}
        if self.eval_taskset is not None:
            entry["eval"] = self.eval_taskset
        if self.oversampled:
            entry["oversampled"] = self.oversampled
        return entry

    @classmethod
    def of(cls, entry: dict) -> "Round":
        """A round restored from the state record: its requests are known by id (results carry task ids, so
        that is enough to finish it), and its failures are not retried."""
        return cls(entry["step"], dict.fromkeys(entry["requests"]), dict(entry.get("results_offsets", {})),
                   entry.get("eval"), oversampled=entry.get("oversampled", 0))


class Window:
    """The training steps published whose results are still being collected, oldest first, at most
    ``explorer.max_inflight_steps``. Steps finish in order, so "finished step k" means every step up to k (the
    trainer's short batches rely on it). A step can finish once all its results are in; or once over-rollout's
    minimum (``explorer.min_results``) arrived ``over_rollout.wait_after_min_s`` ago; or ``step_timeout_s``
    after it was published. A step that dynamic sampling fills with more tasks waits for them."""

    def __init__(self, settings: ExplorerConfig) -> None:
        self.settings = settings
        self.rounds: list[Round] = []

    @property
    def has_room(self) -> bool:
        return len(self.rounds) < self.settings.max_inflight_steps

    @property
    def steps(self) -> list[int]:
        return [round_.step for round_ in self.rounds]

    def add(self, round_: Round) -> None:
        self.rounds.append(round_)

    def restore(self, entries: Iterable[dict]) -> None:
        self.rounds = [Round.of(entry) for entry in entries if "eval" not in entry]

    def pop_finishable(self, now: float) -> Round | None:
        """Take the oldest step if it can finish now (call again for the next one: they finish in order)."""
        if self.rounds and self._can_finish(self.rounds[0], now):
            return self.rounds.pop(0)
        return None

    def timed_out(self, round_: Round, now: float) -> bool:
        return now - round_.started >= self.settings.step_timeout_s

    def _can_finish(self, round_: Round, now: float) -> bool:
        if self.timed_out(round_, now):
            return True
        if not round_.missing:
            return not round_.wants_tasks
        if not self.settings.over_rollout.ratio or len(round_.results) < self.settings.min_results:
            return False
        round_.reached_min_at = round_.reached_min_at or now
        return now - round_.reached_min_at >= self.settings.over_rollout.wait_after_min_s

    def __len__(self) -> int:
        return len(self.rounds)

    def __iter__(self) -> Iterator[Round]:
        return iter(self.rounds)


def train_requests(step: int, batch: list[tuple[int, Task]], repeat_times: int, min_model_version: int,
                   deadline_ms: int | None, taken: Iterable[str] = ()) -> dict[str, RolloutRequest]:
    """Step ``step``'s requests for ``batch`` (epoch, task), by request id: ``s<step>-e<epoch>-<task id>``, made
    unique among themselves and the ids ``taken`` by the step's earlier requests."""
    requests: dict[str, RolloutRequest] = {}
    taken = set(taken)
    for epoch, task in batch:
        request_id = f"s{step}-e{epoch}-{task.task_id}"
        if request_id in requests or request_id in taken:  # the same id from two tasksets (or blocks): two tasks
            request_id += f"-{task.taskset}-{len(requests) + len(taken)}"
        requests[request_id] = RolloutRequest(request_id=request_id, step=step, kind=RolloutKind.TRAIN, task=task,
                                              repeat_times=task.repeat_times or repeat_times,
                                              min_model_version=min_model_version, deadline_ms=deadline_ms)
    return requests


def round_of(rounds: Iterable[Round], request_id: str) -> Round | None:
    """The round in flight that asked for ``request_id``."""
    return next((round_ for round_ in rounds if request_id in round_.requests), None)
