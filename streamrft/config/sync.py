"""``sync:``: how the explorer, the trainer and the rollout workers keep in step. Every knob of the sync policy is
declared here and read in one place, :class:`streamrft.pacing.Pacing` (docs/architecture.md, "Pacing").

These keys used to live under ``explorer:`` (and ``trainer.sync_request_interval``); they still load from
there, with a deprecation message (``streamrft/config/deprecated.py``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section

SyncStyleName = Literal["fixed", "trainer_driven", "fully_async"]


class SyncConfig(Section):
    style: SyncStyleName = Field(
        default="fixed",
        description="fixed: the explorer runs `interval` steps on one version (+ `offset` ahead); trainer_driven: "
                    "workers move when the trainer asks (SYNC_REQUEST); fully_async: workers take each new "
                    "version at once, the explorer at most `max_staleness` steps ahead")
    interval: int = Field(default=1, ge=1, description="the trainer publishes weights every this many steps")
    offset: int = Field(default=0, ge=0, description="fixed: steps the explorer may run beyond the interval")
    max_staleness: int = Field(default=1, ge=0, description="steps the explorer may run ahead of the weights "
                                                            "(trainer_driven, fully_async); the trainer's bound")
    request_interval: int | None = Field(
        default=None, ge=1, description="trainer_driven: ask the workers to move every this many published "
                                        "versions (SYNC_REQUEST); default `interval`")
    max_buffered_batches: int = Field(default=4, ge=1,
                                      description="trainer lag on experiences, in batches, before the explorer "
                                                  "pauses")
