"""The explorer's state record: what it writes about itself on ``control`` (kind EXPLORER_STATE) with every
commit, read back when it restarts and by whoever watches the run (the dashboard, ``streamrft tail``)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from streamrft.schemas import InvalidRecordError

MAX_STEP = 2**31 - 1  # as validation's MAX_VERSION: anything above is a forged or corrupted record


def _fail(reason: str, detail: str) -> None:
    raise InvalidRecordError(reason, detail)


@dataclass
class ExplorerState:
    """What the explorer records about itself (JSON in ``SyncSignal.state``, kind EXPLORER_STATE).

    It references tasks, never embeds them, so the record stays a few KiB whatever the prompts. ``tasksets``
    holds each training taskset's position (``explorer.tasksets``; one, ``tasks``, by default): a topic-fed
    one's ``{"epoch", "pending": [[epoch, partition, offset], ...]}`` (tasks read from its topic but not yet rolled
    out, in rollout order; its committed offsets are the rest), a file-fed one's ``{"epoch", "taken": bitmap}``
    (the file's tasks rolled out this epoch, base64). ``epoch`` is the first taskset's, for people. ``in_flight``
    lists the rounds published whose results are still being collected, oldest first: training steps and eval
    rounds (``"eval": taskset``), each ``{"step", "requests": [ids], "results_offsets": {partition: offset}}``
    (where its results begin on ``results``), and ``"oversampled": n`` once dynamic sampling has added n rounds of
    tasks to a step. ``waiting`` says what holds the next step back ("" when nothing
    does), for whoever watches the run."""

    next_step: int = 0
    epoch: int = 0
    tasksets: dict[str, dict] = field(default_factory=dict)
    in_flight: list[dict] = field(default_factory=list)
    finished_step: int = -1  # every step up to this one has its results in (or cancelled / timed out)
    done: bool = False
    waiting: str = ""

    @property
    def steps_in_flight(self) -> list[int]:
        return [entry["step"] for entry in self.in_flight if "eval" not in entry]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ExplorerState":
        """Tolerant: unknown keys (a newer explorer's) are ignored, an older explorer's single ``awaiting``
        step is read as the one step in flight; a known key of the wrong shape raises InvalidRecordError."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            _fail("bad-state", f"explorer state is not JSON: {exc}")
        if not isinstance(data, dict):
            _fail("bad-state", f"explorer state must be a JSON object, not {type(data).__name__}")
        if "in_flight" not in data and "awaiting" in data:
            data["in_flight"] = [] if data["awaiting"] is None else [data["awaiting"]]
        if "tasksets" not in data and "pending" in data:  # an explorer of one taskset, before tasksets
            from streamrft.config.tasksets import DEFAULT_TASKSET

            data["tasksets"] = {DEFAULT_TASKSET: {"epoch": data.get("epoch", 0), "pending": data["pending"]}}
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        state = cls(**known)
        state._check()
        return state

    def _check(self) -> None:
        def ok(value: Any, kind: type | tuple) -> bool:
            return isinstance(value, kind) and not isinstance(value, bool) if kind is int else isinstance(value, kind)

        if not (ok(self.next_step, int) and ok(self.epoch, int) and ok(self.finished_step, int)
                and isinstance(self.done, bool) and isinstance(self.waiting, str)):
            _fail("bad-state", "explorer state: next_step, epoch, finished_step must be integers, done a boolean, "
                               "waiting a string")
        if not -1 <= self.finished_step < max(self.next_step, 0) + 1 or not 0 <= self.next_step <= MAX_STEP:
            _fail("bad-state", f"explorer state: next_step {self.next_step}, finished_step {self.finished_step} "
                               "are out of range")
        if not isinstance(self.tasksets, dict) or not all(
                isinstance(name, str) and isinstance(position, dict) and ok(position.get("epoch"), int)
                and position["epoch"] >= 0 and isinstance(position.get("pending", []), list)
                and all(isinstance(ref, list) and len(ref) == 3 and all(ok(v, int) and v >= 0 for v in ref)
                        for ref in position.get("pending", []))
                and isinstance(position.get("taken", ""), str)
                for name, position in self.tasksets.items()):
            _fail("bad-state", "explorer state: tasksets must map each name to {epoch, pending: [[epoch, partition, "
                               "offset], ...]} or {epoch, taken}")
        if not isinstance(self.in_flight, list) or not all(
                isinstance(entry, dict) and ok(entry.get("step"), int) and -1 <= entry["step"] < self.next_step + 1
                and isinstance(entry.get("requests"), list) and all(isinstance(r, str) for r in entry["requests"])
                and isinstance(entry.get("results_offsets", {}), dict)
                and all(ok(v, int) for v in entry.get("results_offsets", {}).values())
                and isinstance(entry.get("eval", ""), str)
                and ok(entry.get("oversampled", 0), int) and entry.get("oversampled", 0) >= 0
                for entry in self.in_flight):
            _fail("bad-state", "explorer state: in_flight must be a list of {step, requests: [ids], "
                               "results_offsets, eval?, oversampled?}")


# Who writes which signal, on which topic: the trainer's on ``sync``, the explorer's on ``control``. Each topic
# has one writer principal on a secured cluster (``streamrft acls``), so a kind on the other topic is refused.
