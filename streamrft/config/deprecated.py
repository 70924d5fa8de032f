"""Keys that moved: a config written for an older streamrft still loads, each old key moved to its new place
with a warning that says where it goes now. A key given in both places is an error (which one would win is not
obvious)."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# (section, old key) -> (section, new key)
MOVED_KEYS: dict[tuple[str, str], tuple[str, str]] = {
    # the sync policy is one section (streamrft/pacing.py reads it)
    ("explorer", "sync_style"): ("sync", "style"),
    ("explorer", "sync_interval"): ("sync", "interval"),
    ("explorer", "sync_offset"): ("sync", "offset"),
    ("explorer", "max_staleness"): ("sync", "max_staleness"),
    ("explorer", "max_buffered_batches"): ("sync", "max_buffered_batches"),
    ("trainer", "sync_request_interval"): ("sync", "request_interval"),
    # explorer steps and optimiser steps no longer share a name (trainer.total_steps stays the latter)
    ("explorer", "total_steps"): ("explorer", "max_steps"),
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
        target = moved.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # the section itself is malformed: its validation says so
        if new in target:
            raise ValueError(f"{section}.{old} and {new_section}.{new} are both set; keep {new_section}.{new} "
                             f"({section}.{old} is its old name)")
        target[new] = part.pop(old)
        logger.warning("config: %s.%s is deprecated; write it as %s.%s", section, old, new_section, new)
    return moved
