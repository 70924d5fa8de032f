"""Records as a person reads them: key, coordinates, time, the decoded value (through the run's Serde: the
registry's wire format or single-object framing) or why it does not decode, and a dead letter's headers."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum

from streamrft.schemas import DecodeError
from streamrft.schemas.packing import unpack_f32, unpack_i32, unpack_u8
from ..kafka.dlq import HEADER_PREFIX
from ..kafka.reader import RawRecord

SHOWN_ITEMS = 12  # of a packed array (token ids, logprobs): the first ones and the length
# Experience's packed little-endian arrays and how to read them
PACKED = {"tokens": unpack_i32, "logprobs": unpack_f32, "action_mask": unpack_u8, "token_rewards": unpack_f32,
          "teacher_logprobs": unpack_f32}


@dataclass(frozen=True, slots=True)
class ShownRecord:
    raw: RawRecord
    type: str | None  # the record type, None when it does not decode
    value: str  # the decoded fields as indented JSON, or why the bytes do not decode

    @property
    def key(self) -> str:
        return text_of(self.raw.key)

    @property
    def time(self) -> str:
        return when(self.raw.timestamp_ms)

    def header(self, name: str) -> str:
        """A dead-letter header (``reason``, ``source.topic`` ...), '' when absent."""
        for key, value in self.raw.headers:
            if key == HEADER_PREFIX + name:
                return text_of(value)
        return ""


def text_of(data: bytes | None) -> str:
    return "" if data is None else data.decode(errors="replace")


def when(timestamp_ms: int) -> str:
    if timestamp_ms <= 0:
        return ""
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def shown(raw: RawRecord, serde) -> ShownRecord:
    try:
        record = serde.decode(raw.value, raw.topic)
    except DecodeError as exc:
        size = len(raw.value or b"")
        return ShownRecord(raw, None, f"does not decode ({size} bytes): {exc}")
    fields = {name: _unpacked(name, value) for name, value in record.to_dict().items()}
    return ShownRecord(raw, record.schema_name, json.dumps(fields, indent=1, ensure_ascii=False, default=str))


def _unpacked(name: str, value):
    """A packed array as its first items and its length; any other field as ``_plain`` makes it."""
    if name in PACKED and isinstance(value, bytes):
        try:
            items = PACKED[name](value).tolist()
        except ValueError:
            return _plain(value)
        more = f" … ({len(items)} in all)" if len(items) > SHOWN_ITEMS else ""
        return " ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in items[:SHOWN_ITEMS]) + more
    return _plain(value)


def _plain(value):
    """JSON-friendly: enums by name, other bytes by their length and first ones in hex."""
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, bytes):
        return f"<{len(value)} bytes: {value[:32].hex()}{'…' if len(value) > 32 else ''}>"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
