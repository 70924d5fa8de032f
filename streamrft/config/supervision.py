"""``launch.restart``: how ``streamrft run`` supervises its role processes (``streamrft/launch/supervision.py``
applies it; ``streamrft k8s`` says the same to Kubernetes)."""
from __future__ import annotations

from pydantic import Field, model_validator

from .base import Section


class RestartConfig(Section):
    """A role that exits with a non-zero code (a crash, a kill, an error it could not ride out) is started again
    with the same command after a back-off that doubles from ``backoff_s`` up to ``backoff_max_s`` for each crash
    within the last ``window_s``; it resumes from its committed offsets and checkpoint. More than
    ``max_restarts`` restarts of one role within ``window_s`` is a crash loop: the run stops and names the role,
    its exit code and the end of its log. A role that exits with 0 has ended its work (or was asked to stop) and is
    never restarted."""

    max_restarts: int = Field(default=5, ge=0, le=1000,
                              description="restarts of one role allowed within window_s; 0 = a crash stops the run")
    window_s: float = Field(default=600.0, gt=0, le=86_400,
                            description="the crash-loop window (seconds): crashes older than this are forgotten")
    backoff_s: float = Field(default=1.0, ge=0, le=600, description="wait before the first restart (seconds)")
    backoff_max_s: float = Field(default=30.0, ge=0, le=3600,
                                 description="cap of the doubling back-off between restarts (seconds)")

    @model_validator(mode="after")
    def _cap_above_start(self) -> "RestartConfig":
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"launch.restart.backoff_max_s ({self.backoff_max_s:g}) must be at least backoff_s "
                             f"({self.backoff_s:g}): it caps the doubling back-off that starts there")
        return self
