"""When may the explorer publish step ``s``? The staleness bound as explicit, tested arithmetic.

Versions count trainer steps whose weights are published; trainer step ``t`` trains on explorer step ``t``'s
experiences, and the trainer publishes every ``sync_interval`` steps (versions k, 2k, ...).

- ``fixed``: like Trinity-RFT, the explorer runs ``sync_interval`` steps on one version, then waits for the next
  sync; ``sync_offset`` lets it run that many steps further ahead. Required version for step s:
  ``floor(s / k) · k − sync_offset``.
- ``trainer_driven`` and ``fully_async``: the explorer may be at most ``max_staleness`` steps ahead of the
  weights: required version ``s − max_staleness``. Under ``trainer_driven`` "the weights" are the version the
  trainer last asked the workers to move to (its SYNC_REQUEST), not the newest it published.
"""
from __future__ import annotations


def required_version(step: int, style: str, sync_interval: int, sync_offset: int, max_staleness: int) -> int:
    if style == "fixed":
        return max(0, (step // sync_interval) * sync_interval - sync_offset)
    return max(0, step - max_staleness)


def may_publish(step: int, version: int, style: str, sync_interval: int, sync_offset: int,
                max_staleness: int) -> bool:
    return version >= required_version(step, style, sync_interval, sync_offset, max_staleness)


def lag_allows(lag: int, max_buffered_batches: int, experiences_per_step: int) -> bool:
    """The trainer's unconsumed backlog on ``experiences`` is within ``max_buffered_batches`` steps."""
    return lag <= max_buffered_batches * experiences_per_step
