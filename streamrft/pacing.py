"""The sync policy in one place: when the explorer may publish a step, which weights its requests name, when the
trainer publishes and asks workers to move, how stale a trained experience may be, and whether workers take
every new version at once. Built once from the run config (``Pacing.of``); the explorer, the trainer, the rollout
workers and the dashboard ask it, and none of them looks at a style's name (serve mode takes every new version
whatever the style: its traffic is online learning). docs/architecture.md
("Pacing") draws it.

Versions count trainer steps whose weights are published; trainer step ``t`` trains on explorer step ``t``'s
experiences and publishes every ``interval`` steps (versions k, 2k, ...).

- ``fixed``: like Trinity-RFT, the explorer runs ``interval`` steps on one version, then waits for the next
  sync; ``offset`` lets it run that many steps further ahead. Required version for step s:
  ``floor(s / k) · k − offset``. The trainer therefore sees experiences up to ``k − 1 + offset`` versions old by
  design, so its staleness bound is never tighter than that.
- ``trainer_driven`` and ``fully_async``: the explorer may be at most ``max_staleness`` steps ahead of the
  weights: required version ``s − max_staleness``. Under ``trainer_driven`` "the weights" are the version the
  trainer last asked the workers to move to (its SYNC_REQUEST, every ``request_interval`` versions), not the
  newest it published, and requests name exactly that version. Under ``fully_async`` workers load each new
  version as soon as their engine is drained.
- a run without a trainer (``mode: explore``, ``streamrft/run_shape.py``): nothing is paced on one: every step
  may be published and requests take whatever weights the workers serve.

Besides the weights, the trainer's backlog paces the explorer: it holds back while more than
``max_buffered_batches`` steps' experiences are untrained.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from streamrft.config import RunConfig


class SyncStyle(StrEnum):
    FIXED = "fixed"
    TRAINER_DRIVEN = "trainer_driven"
    FULLY_ASYNC = "fully_async"


class Versions(Protocol):
    """What pacing needs to know of the trainer's signals (``streamrft.sync.SyncView`` has it)."""

    @property
    def version(self) -> int:
        """The newest published weights version (0: none yet)."""

    @property
    def requested_version(self) -> int:
        """The newest version the trainer asked the workers to move to (0: none yet)."""


class Hold(NamedTuple):
    """Why a step may not be published now: ``cause`` (weights, lag, cluster) and what it waits for, in words."""

    cause: str
    waits_for: str


@dataclass(frozen=True)
class Pacing:
    style: SyncStyle
    interval: int = 1
    offset: int = 0
    max_staleness: int = 1
    request_interval: int | None = None
    max_buffered_batches: int = 4
    experiences_per_step: int = 1
    paced: bool = True  # False: the run has no trainer to wait for (RunShape.paces_on_trainer)

    @classmethod
    def of(cls, config: "RunConfig") -> "Pacing":
        sync, explorer = config.sync, config.explorer
        return cls(style=SyncStyle(sync.style), interval=sync.interval, offset=sync.offset,
                   max_staleness=sync.max_staleness, request_interval=sync.request_interval,
                   max_buffered_batches=sync.max_buffered_batches,
                   experiences_per_step=explorer.batch_size * explorer.repeat_times,
                   paced=config.shape.paces_on_trainer)

    # -- the explorer ---------------------------------------------------------------------------------------
    def required_version(self, step: int) -> int:
        """The weights version step ``step`` may be published on (module docstring)."""
        if not self.paced:
            return 0
        if self.style == SyncStyle.FIXED:
            return max(0, (step // self.interval) * self.interval - self.offset)
        return max(0, step - self.max_staleness)

    def counted_version(self, versions: Versions) -> int:
        """The version pacing counts: what the trainer asked for under ``trainer_driven``, else the newest."""
        return versions.requested_version if self.style == SyncStyle.TRAINER_DRIVEN else versions.version

    def hold(self, step: int, versions: Versions, trainer_lag: Callable[[], int | None]) -> Hold | None:
        """What keeps step ``step`` from being published now, or None. ``trainer_lag()``: the trainer's
        unconsumed experiences (None when the cluster does not answer); asked only when the weights allow the
        step, and never in explore mode."""
        if not self.paced:  # no trainer: neither weights nor a trainer's lag will ever come
            return None
        need, have = self.required_version(step), self.counted_version(versions)
        if have < need:
            what = "the trainer's sync request for" if self.style == SyncStyle.TRAINER_DRIVEN else "weights"
            return Hold("weights", f"{what} v{need} (has v{have})")
        lag = trainer_lag()
        if lag is None:
            return Hold("cluster", "the trainer's lag (the cluster does not answer)")
        if not self.lag_allows(lag):
            return Hold("lag", f"the trainer ({lag} experiences untrained; max_buffered_batches "
                               f"{self.max_buffered_batches})")
        return None

    def lag_allows(self, lag: int) -> bool:
        """The trainer's unconsumed backlog on ``experiences`` is within ``max_buffered_batches`` steps."""
        return lag <= self.max_buffered_batches * self.experiences_per_step

    def min_model_version(self, step: int, versions: Versions) -> int:
        """The ``min_model_version`` step ``step``'s requests name: 0 (anything) in explore mode, the requested
        version under ``trainer_driven`` (workers move when the trainer says so, and no further), else the
        version the step was allowed to be published on."""
        if not self.paced:
            return 0
        if self.style == SyncStyle.TRAINER_DRIVEN:
            return versions.requested_version
        return self.required_version(step)

    # -- the trainer ----------------------------------------------------------------------------------------
    @property
    def staleness_bound(self) -> int:
        """Versions an experience may lag behind the weights being trained before the staleness policy applies:
        ``max_staleness``, and under ``fixed`` never less than ``interval − 1 + offset`` (else fixed pacing
        would drop its own batches)."""
        if self.style == SyncStyle.FIXED:
            return max(self.max_staleness, self.interval - 1 + self.offset)
        return self.max_staleness

    def publishes_at(self, version: int) -> bool:
        """Whether the trainer publishes the weights once they are ``version`` (every ``interval`` steps)."""
        return version % self.interval == 0

    def sync_request_due(self, version: int) -> bool:
        """``trainer_driven``: whether publishing ``version`` also asks the workers to move to it."""
        if self.style != SyncStyle.TRAINER_DRIVEN:
            return False
        return version % (self.request_interval or self.interval) == 0

    @property
    def buffered_steps(self) -> int:
        """How many steps' experiences the trainer may hold read but untrained: the explorer's backlog bound and
        the batch being assembled."""
        return self.max_buffered_batches + 1

    # -- rollout workers and serve mode ---------------------------------------------------------------------
    @property
    def follows_latest(self) -> bool:
        """Whether an engine takes every new version as soon as it can (``fully_async``), rather than only the
        version a request names."""
        return self.style == SyncStyle.FULLY_ASYNC

    # -- the dashboard --------------------------------------------------------------------------------------
    def describe(self) -> str:
        """What paces the explorer, in a few words."""
        if not self.paced:
            return f"explore mode: no trainer, {self.style.value} not applied"
        if self.style == SyncStyle.FIXED:
            return f"fixed: sync every {self.interval} step(s), offset {self.offset}"
        bound = f"at most {self.max_staleness} step(s) ahead of the weights"
        if self.style == SyncStyle.TRAINER_DRIVEN:
            return f"trainer_driven: {bound} the trainer requested"
        return f"fully_async: {bound}"
