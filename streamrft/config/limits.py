"""Caps on what one record may ask of the run. Work over a cap (a task asking for 10,000 samples, 500 turns,
a 100k-token prompt, a weights version that never comes) fails that request with the reason instead of
walking from worker to worker; a record over a size cap is dead-lettered where it is read. The caps on a task's
work are declared once, in :class:`streamrft.engines.settings.limits.WorkLimits`; the keys below are the
roles' own."""
from __future__ import annotations

from pydantic import Field

from streamrft.engines.settings.limits import WorkLimits

from .base import Section


class LimitsConfig(WorkLimits, Section):
    max_task_bytes: int = Field(default=1 << 20, ge=1024,
                                description="largest Task (payload included) the explorer takes; larger: DLQ")
    max_version_wait_s: float = Field(default=600.0, gt=0,
                                      description="a request waiting longer for its min_model_version FAILS")
