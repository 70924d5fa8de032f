"""The JSON that the trainer's collective signals carry in ``SyncSignal.state``, written and parsed here only (no
torch, so ``streamrft.validation`` checks it where a role reads ``sync``, and the weight follower where it acts).

* :class:`Announcement`, of an ``NCCL_READY``: the session whose keys the membership store holds, how many
  receivers the trainer waits for at its first sync, the broadcast's bucket size, and the backend the trainer
  chose (its device's); receivers follow it whatever their own device.
* :class:`DeliveryState`, of a collective ``WEIGHTS_PUBLISHED``: which epoch of the elastic group carried the
  version to which members, where a receiver that missed it finds it (a manifest URI; its sha256 is the
  signal's), and the digest of the tensors broadcast (``broadcast_digest``), which receivers check before loading.

Each ``parse`` returns what ``to_json`` wrote, or raises ValueError naming the field that is wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BACKENDS = ("gloo", "nccl")
MAX_RECEIVERS = 1 << 16
_SESSION_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Announcement:
    session: str
    receivers: int
    bucket_bytes: int
    backend: str

    def to_json(self) -> str:
        return json.dumps({"session": self.session, "receivers": self.receivers, "bucket_bytes": self.bucket_bytes,
                           "backend": self.backend})

    @classmethod
    def parse(cls, state: str) -> "Announcement":
        value = _object(state, "NCCL_READY")
        session, receivers = value.get("session"), value.get("receivers")
        bucket_bytes, backend = value.get("bucket_bytes", 1), value.get("backend")
        if not isinstance(session, str) or not 1 <= len(session) <= 64 or not set(session) <= _SESSION_CHARS:
            raise ValueError(f"session {session!r} is not a hex token")
        if not _is_int(receivers) or not 0 <= receivers <= MAX_RECEIVERS:
            raise ValueError(f"receivers {receivers!r} is not an integer in 0..{MAX_RECEIVERS}")
        if not _is_int(bucket_bytes) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes {bucket_bytes!r} is not a positive integer")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not gloo or nccl")
        return cls(session, receivers, bucket_bytes, backend)


@dataclass(frozen=True)
class DeliveryState:
    epoch: int
    receivers: tuple[str, ...]
    catch_up: str
    digest: str = ""  # BLAKE3 of the tensors broadcast; "" when nothing was broadcast

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "receivers": list(self.receivers), "catch_up": self.catch_up,
                           "digest": self.digest})

    @classmethod
    def parse(cls, state: str) -> "DeliveryState":
        """An empty state is a version delivered to nobody, with no catch-up copy."""
        if not state:
            return cls(0, (), "")
        value = _object(state, "collective WEIGHTS_PUBLISHED")
        epoch, receivers, catch_up = value.get("epoch", 0), value.get("receivers", []), value.get("catch_up", "")
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch {epoch!r} is not an integer >= 0")
        if not isinstance(receivers, list) or not all(isinstance(r, str) for r in receivers):
            raise ValueError("receivers is not a list of member ids")
        if not isinstance(catch_up, str):
            raise ValueError("catch_up is not a URI")
        digest = value.get("digest", "")
        if not isinstance(digest, str) or (digest and not _is_hex_digest(digest)):
            raise ValueError(f"digest {digest!r} is not 64 lowercase hex digits")
        return cls(epoch, tuple(receivers), catch_up, digest)


def _object(state: str, kind: str) -> dict[str, Any]:
    try:
        value = json.loads(state)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"the state of a {kind} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"the state of a {kind} is not a JSON object")
    return value


def _is_hex_digest(value: str) -> bool:
    return len(value) == 64 and set(value) <= _SESSION_CHARS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
