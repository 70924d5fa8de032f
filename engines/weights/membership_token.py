"""Who may join the weight-sync group: every entry a receiver writes to the membership store (a join, a leave,
"ready" for an epoch) carries an HMAC-SHA256 over the session, the entry's place and its content, keyed with a
secret the trainer and its receivers share (``trainer.weights.group_secret``). The store itself (a torch
``TCPStore``) has no authentication: the token is what tells the trainer an entry came from one of its own.

The place is part of what is signed (the log index, the epoch), so a token read from the store is worth nothing
anywhere else: copying a member's join to a new index, or its "ready" to a later epoch, does not verify.

Without a secret every token is empty and every entry is admitted (membership open, as when the store is on
loopback only); the trainer says so in its log."""
from __future__ import annotations

import hashlib
import hmac


class MembershipTokens:
    """Signs and checks membership entries with ``secret`` (None: open membership, nothing checked)."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret or None

    @property
    def open(self) -> bool:
        return self._secret is None

    def sign(self, *parts: str) -> str:
        if self._secret is None:
            return ""
        return hmac.new(self._secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()

    def valid(self, token: object, *parts: str) -> bool:
        if self._secret is None:
            return True
        return isinstance(token, str) and hmac.compare_digest(token, self.sign(*parts))
