"""Where a replay / fan-out trainer (``--replay-from``) starts reading ``experiences``."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from streamrft.errors import ConfigError

_EPOCH_MS_FROM = 10**12  # a --replay-from integer this large is epoch milliseconds (2001 on), not an offset


@dataclass(frozen=True)
class ReplayStart:
    """Where a replay starts: an offset on every partition, or the first record at/after a time."""

    offset: int | None = None
    timestamp_ms: int | None = None

    def __str__(self) -> str:
        if self.offset is not None:
            return f"offset {self.offset}"
        return datetime.fromtimestamp(self.timestamp_ms / 1000, timezone.utc).isoformat()


def parse_replay_from(text: str) -> ReplayStart:
    """``--replay-from``: ``earliest``, an offset (``1200``), epoch milliseconds (``1767225600000``; integers
    from 10^12 on are times) or an ISO 8601 time (``2026-01-01T12:00:00``; UTC when no zone is given)."""
    value = text.strip()
    if value.lower() in ("earliest", "beginning", "start"):
        return ReplayStart(offset=0)
    if value.lstrip("-").isdigit():
        number = int(value)
        if number < 0:
            raise ConfigError(f"--replay-from {text!r}: offsets and times are >= 0")
        return ReplayStart(timestamp_ms=number) if number >= _EPOCH_MS_FROM else ReplayStart(offset=number)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--replay-from {text!r} is neither an offset, epoch milliseconds nor an ISO 8601 time "
                          "(e.g. 2026-01-01T12:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return ReplayStart(timestamp_ms=(when - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(milliseconds=1))
