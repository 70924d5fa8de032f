"""``explorer.tasksets``: several training tasksets in one run, each from a file or a topic, mixed by weight.

Each step's ``batch_size`` tasks are drawn across the tasksets by weight (seeded per step, so a resumed explorer
draws the same), each taskset in its own order. A taskset read from a topic keeps its position in the explorer's
transaction like ``tasks`` (its topic is ``tasks`` itself or ``tasks.<name>``, created with the run's topics); one
read from a file is read by the explorer itself, its position in the explorer's state record. With no tasksets
configured the run has one, ``tasks``: the ``tasks`` topic in ``explorer.selector``'s order, as before.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section

DEFAULT_TASKSET = "tasks"


class TasksetOrder(Section):
    """In what order a taskset's tasks are rolled out within an epoch.

    ``sequential`` (the source's order), ``shuffle`` (seeded, per epoch), ``field`` (by the payload's ``field``,
    ascending or ``descending``: a curriculum), ``difficulty``: tasks the policy fails first (priority 1 − pass
    rate, from ``results``; unseen tasks 0.5), and with ``skip_solved`` a task solved in every sample of its
    latest rollout is not rolled out again (DAPO / POLARIS's "skip solved prompts"); or ``learnable``: pass rate
    closest to 0.5 first (what ``explorer.selector.kind: difficulty`` does for the ``tasks`` topic)."""

    kind: Literal["sequential", "shuffle", "field", "difficulty", "learnable"] = Field(
        default="sequential", description="sequential (the source's order), shuffle (seeded, per epoch), field "
                                          "(by a payload field: a curriculum), difficulty (failed first) or "
                                          "learnable (pass rate closest to 0.5 first)")
    field: str | None = Field(default=None, description="kind field: the payload field to order by")
    descending: bool = Field(default=False, description="kind field: largest value first")
    skip_solved: bool = Field(default=False, description="kind difficulty: skip tasks solved every time")
    seed: int = Field(default=0, description="kind shuffle: the seed of each epoch's permutation")

    @model_validator(mode="after")
    def _field_named(self) -> "TasksetOrder":
        if self.kind == "field" and not self.field:
            raise ValueError("order kind field needs `field`: the payload field to order by")
        if self.skip_solved and self.kind != "difficulty":
            raise ValueError("skip_solved applies to order kind difficulty")
        return self


class TasksetConfig(Section):
    """One training taskset. Exactly one source: ``path`` (a task file: JSONL, JSON array, CSV, Parquet) or
    ``topic`` (``tasks``, the run's tasks topic, or another name: the run's topic ``tasks.<name>``; produce to it
    with ``streamrft tasks produce FILE --taskset <name>``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="the taskset's name, in its tasks' taskset field "
                                                              "and its metrics")
    weight: float = Field(default=1.0, gt=0, description="share of each step's tasks, relative to the others'")
    path: str | None = Field(default=None, description="source: a task file the explorer reads itself")
    topic: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$",
                              description="source: tasks (the run's tasks topic) or NAME (the run's topic "
                                          "tasks.NAME)")
    prompt_key: str = Field(default="question", description="path: the row's column that holds the prompt (a "
                                                            "topic's tasks carry their own)")
    answer_key: str | None = Field(default="answer", description="path: the row's column that holds the reference "
                                                                 "answer; none = the tasks have none")
    workflow: str | None = Field(default=None, description="the workflow every task of the taskset runs (file or "
                                                           "topic); none = each task's own")
    reward_fn: str | None = Field(default=None, description="the reward every task of the taskset is scored with; "
                                                            "none = each task's own")
    repeat_times: int | None = Field(default=None, ge=1, description="samples per task of this taskset; none = "
                                                                     "the task's own, else explorer.repeat_times")
    epochs: int | None = Field(default=None, ge=1, description="passes over the taskset; default "
                                                               "explorer.total_epochs (null: stream)")
    order: TasksetOrder = Field(default=TasksetOrder(), description="the order of the taskset's tasks within an "
                                                                    "epoch")

    @model_validator(mode="after")
    def _one_source(self) -> "TasksetConfig":
        if (self.path is None) == (self.topic is None):
            raise ValueError(f"taskset {self.name!r}: give exactly one source, `path` (a task file) or `topic`")
        return self

    @property
    def topic_suffix(self) -> str | None:
        """The run topic it reads (``tasks`` or ``tasks.<topic>``), None for a file."""
        if self.topic is None:
            return None
        return DEFAULT_TASKSET if self.topic == DEFAULT_TASKSET else f"{DEFAULT_TASKSET}.{self.topic}"


def check_tasksets(tasksets: tuple[TasksetConfig, ...]) -> None:
    """Unique names, one taskset per topic."""
    names = [t.name for t in tasksets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"explorer.tasksets: each taskset needs its own name ({', '.join(twice)} repeated)")
    topics = [t.topic_suffix for t in tasksets if t.topic_suffix]
    shared = sorted({t for t in topics if topics.count(t) > 1})
    if shared:
        raise ValueError(f"explorer.tasksets: topic {', '.join(shared)} feeds two tasksets; a topic is one "
                         "taskset's (its offsets are that taskset's position)")
