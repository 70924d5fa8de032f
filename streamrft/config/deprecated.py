"""Keys that moved: a config written for an older streamrft still loads, each old key moved to its new place
with a warning that says where it goes now. A key given in both places with different values is an error (which
one would win is not obvious)."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# (section, old key) -> (section, new key); section None: the top level
MOVED_KEYS: dict[tuple[str, str], tuple[str | None, str]] = {
    # the sync policy is one section (streamrft/pacing.py reads it)
    ("explorer", "sync_style"): ("sync", "style"),
    ("explorer", "sync_interval"): ("sync", "interval"),
    ("explorer", "sync_offset"): ("sync", "offset"),
    ("explorer", "max_staleness"): ("sync", "max_staleness"),
    ("explorer", "max_buffered_batches"): ("sync", "max_buffered_batches"),
    ("trainer", "sync_request_interval"): ("sync", "request_interval"),
    # explorer steps and optimiser steps no longer share a name (trainer.total_steps stays the latter)
    ("explorer", "total_steps"): ("explorer", "max_steps"),
    # the mode says which roles a run has, not how its explorer behaves (streamrft/run_shape.py)
    ("explorer", "mode"): (None, "mode"),
}


def move_keys(raw: Any) -> Any:
    """The run config's raw mapping with every moved key in its new place (logged once per load)."""
    if not isinstance(raw, dict):
        return raw
    moved = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    for (section, old), (new_section, new) in MOVED_KEYS.items():
        part = moved.get(section)
        if not isinstance(part, dict) or old not in part:
            continue
        target = moved if new_section is None else moved.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # the section itself is malformed: its validation says so
        new_name = new if new_section is None else f"{new_section}.{new}"
        value = part.pop(old)
        if new in target and target[new] != value:
            raise ValueError(f"{section}.{old} and {new_name} are both set, to different values; keep {new_name} "
                             f"({section}.{old} is its old name)")
        target[new] = value
        logger.warning("config: %s.%s is deprecated; write it as %s", section, old, new_name)
    return moved
