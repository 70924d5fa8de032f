"""Where published weights live, checked without loading them (no torch): the lineage ids, the version directory
names under a store's base URL, the manifest's sha256, and whether an announced URI is a manifest of this store
at all (:func:`check_manifest_uri`). ``object_store`` writes by these names; ``streamrft.validation`` and the
weight follower check what a signal announces by them."""
from __future__ import annotations

import posixpath
import re
import time
import uuid
from typing import Any
from urllib.parse import unquote

import fsspec

from .errors import ForeignUriError

MANIFEST_NAME = "manifest.json"
_LINEAGE = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"  # goes into a directory name: no '/', no '.'
_LINEAGE_RE = re.compile(rf"^{_LINEAGE}$")
_VERSION_DIR = re.compile(rf"^v(\d{{8,}})(?:-({_LINEAGE}))?$")
HEX256 = re.compile(r"^[0-9a-f]{64}$")  # a 256-bit digest in hex: sha256 or BLAKE3


def new_lineage() -> str:
    """A fresh lineage id for one trainer lifetime: UTC start time (readable, roughly ordered) + random."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def check_lineage(lineage: str) -> str:
    """``lineage`` if it can name a directory ('' = none); ValueError otherwise."""
    if lineage and not _LINEAGE_RE.match(lineage):
        raise ValueError(f"lineage {lineage!r} must be letters, digits, '-' and '_' (at most 64), or empty")
    return lineage


def version_dir_name(version: int, lineage: str = "") -> str:
    """``v00000007`` or ``v00000007-<lineage>``: where a version of a lineage lives under the base URL."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    check_lineage(lineage)
    return f"v{version:08d}-{lineage}" if lineage else f"v{version:08d}"


def parse_version_dir(name: str) -> tuple[str, int] | None:
    """``(lineage, version)`` of a directory named by :func:`version_dir_name`; None for any other name."""
    match = _VERSION_DIR.match(name)
    return (match.group(2) or "", int(match.group(1))) if match else None


def is_sha256(value: object) -> bool:
    return isinstance(value, str) and bool(HEX256.match(value))


def check_manifest_uri(store_url: str, uri: str, version: int, lineage: str = "",
                       storage_options: dict[str, Any] | None = None) -> str:
    """``uri`` if it is exactly the manifest of ``version`` of ``lineage`` under ``store_url``; else
    ForeignUriError. Same fsspec protocol (and chain) as the store, no ``.``/``..`` path segment (also
    percent-encoded), no other directory. The store's filesystem class is the only one imported: a URI of another
    protocol is refused before fsspec loads anything for it."""
    base_chain, _, base_last = store_url.rpartition("::")
    chain, _, last = uri.rpartition("::")
    if chain != base_chain:
        raise ForeignUriError(uri, store_url, f"fsspec chain {chain!r}, the store's is {base_chain!r}")
    base_protocol = _protocol(base_last)
    protocol = _protocol(last)
    cls = fsspec.get_filesystem_class(base_protocol)
    known = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    if protocol not in {"file" if p == "local" else p for p in known}:
        raise ForeignUriError(uri, store_url, f"protocol {protocol!r}, the store's is {base_protocol!r}")
    raw = fsspec.core.split_protocol(last)[1]
    segments = set(raw.split("/")) | set(unquote(raw).split("/"))
    if segments & {".", ".."}:
        raise ForeignUriError(uri, store_url, "'.' or '..' in the path")
    fs, root = fsspec.core.url_to_fs(store_url, **(storage_options or {}))
    expected = posixpath.join(root.rstrip("/") or "/", version_dir_name(version, lineage), MANIFEST_NAME)
    actual = fs._strip_protocol(last)
    if actual != expected:
        raise ForeignUriError(uri, store_url, f"v{version} of lineage {lineage!r} is published at "
                                              f"{fs.unstrip_protocol(expected)}")
    return uri


def _protocol(url: str) -> str:
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    return "file" if protocol == "local" else protocol
