"""Access to a weight store that its server refuses (wrong key, wrong secret, no rights) becomes one
:class:`StoreAccessError` naming the store and the server's reason: the same error whichever fsspec backend
refused, and never a secret in it, even if a backend were to quote its own settings."""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .errors import StoreAccessError

_SECRET_WORDS = ("secret", "token", "password", "credential")


def secrets_in(options: Mapping[str, Any] | None) -> list[str]:
    """The values of secret-named keys in fsspec storage options (``secret``, ``token``, nested ones too)."""
    found = []
    for key, value in (options or {}).items():
        if isinstance(value, Mapping):
            found += secrets_in(value)
        elif isinstance(value, str) and value and any(word in str(key).lower() for word in _SECRET_WORDS):
            found.append(value)
    return found


def redact(text: str, secrets: list[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "<secret>")
    return text


@contextmanager
def store_access(url: str, storage_options: Mapping[str, Any] | None) -> Iterator[None]:
    try:
        yield
    except StoreAccessError:
        raise
    except PermissionError as exc:
        reason = redact(str(exc) or type(exc).__name__, secrets_in(storage_options))
        raise StoreAccessError(url, reason) from None  # the backend's chain may carry its request, headers and all


def guarded(method):
    """An ObjectStore method under :func:`store_access` of its store (``self.url``, ``self.storage_options``)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with store_access(self.url, self.storage_options):
            return method(self, *args, **kwargs)
    return wrapper
