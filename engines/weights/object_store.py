"""Weight publishing through any fsspec URL (a local directory by default; ``s3://``, ``gs://``, ... with the
matching fsspec backend installed).

Layout under the base URL::

    v00000007/model-00001-of-00002.safetensors
    v00000007/model-00002-of-00002.safetensors
    v00000007/manifest.json        <- written last; its presence means the version is complete

Shards are size-bounded safetensors files. The manifest lists, per shard, its file name, byte size, sha256 and
tensor names; per tensor its dtype and shape; and ``sha256`` of the whole, defined as
``sha256(concat(raw digest of each shard, in order))`` — it changes iff any shard's content changes.
Each file is written under a temporary name and then moved into place, so a reader never sees half a file.
:meth:`ObjectStore.publish` returns ``(manifest uri, sha256 of the manifest bytes, total shard bytes)`` — what a
``SyncSignal(WEIGHTS_PUBLISHED)`` carries; a reader passes that sha256 back to :func:`load_weights`, which
verifies the manifest, then every shard, and raises :class:`ShardIntegrityError` naming a bad shard.

Cost: the bytes are written and read once each (local shards are memory-mapped on load), plus one sha256 pass
on each side, spread over a few threads (one per shard, up to 4); sha256, not I/O, bounds it on a fast disk.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from streamrft.schemas import now_ms

from .errors import ManifestIntegrityError, ShardIntegrityError, WeightFormatError
from .safetensors_io import (
    CHUNK_BYTES,
    OverlappedSha256,
    SafetensorsFormatError,
    read_safetensors,
    write_safetensors,
)

logger = logging.getLogger(__name__)

FORMAT = "streamrft.weights/1"
MANIFEST_NAME = "manifest.json"
DEFAULT_MAX_SHARD_BYTES = 256 << 20  # small enough to hash several shards in parallel and bound memory
_VERSION_DIR = re.compile(r"^v(\d{8})$")


class PublishedWeights(NamedTuple):
    uri: str  # of the manifest
    sha256: str  # of the manifest bytes
    nbytes: int  # total bytes of the shards


@dataclass(frozen=True)
class ShardEntry:
    file: str
    nbytes: int
    sha256: str
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    version: int
    shards: tuple[ShardEntry, ...]
    tensors: dict[str, TensorEntry]
    sha256: str  # of the whole: sha256 over the shards' raw digests, in order
    total_bytes: int
    created_at: int
    metadata: dict[str, str]

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "created_at": self.created_at,
            "total_bytes": self.total_bytes,
            "sha256": self.sha256,
            "metadata": self.metadata,
            "shards": [
                {"file": s.file, "nbytes": s.nbytes, "sha256": s.sha256, "tensors": list(s.tensors)}
                for s in self.shards
            ],
            "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in self.tensors.items()},
        }
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, uri: str = "") -> "Manifest":
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise WeightFormatError(f"manifest {uri}: format {doc.get('format')!r}, expected {FORMAT!r}")
            return cls(
                version=int(doc["version"]),
                shards=tuple(
                    ShardEntry(s["file"], int(s["nbytes"]), s["sha256"], tuple(s["tensors"])) for s in doc["shards"]
                ),
                tensors={n: TensorEntry(t["dtype"], tuple(t["shape"])) for n, t in doc["tensors"].items()},
                sha256=doc["sha256"],
                total_bytes=int(doc["total_bytes"]),
                created_at=int(doc["created_at"]),
                metadata=dict(doc.get("metadata", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightFormatError(f"manifest {uri} is not a valid {FORMAT} manifest: {exc!r}") from exc


def content_sha256(shard_digests: Iterable[str]) -> str:
    """The manifest's ``sha256`` of the whole: sha256 over the shards' raw digests, in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in shard_digests)).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plan_shards(named: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy, order-preserving: a shard closes before the tensor that would take it over ``max_bytes``
    (a tensor larger than that gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def _io_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _cpu_tensors(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors (no copy for tensors that already are)."""
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in items}


class ObjectStore:
    """Versioned weight snapshots under one fsspec base URL, keeping the newest ``keep_last``."""

    def __init__(
        self,
        url: str,
        *,
        keep_last: int = 3,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.url = url
        self.keep_last = keep_last
        self.max_shard_bytes = max_shard_bytes
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))

    def _version_dir(self, version: int) -> str:
        return f"{self.root.rstrip('/')}/v{version:08d}"

    def manifest_uri(self, version: int) -> str:
        return self.fs.unstrip_protocol(f"{self._version_dir(version)}/{MANIFEST_NAME}")

    def _write_atomic(self, path: str, write) -> Any:
        """``write(file)`` into a temporary name next to ``path``, then move it into place."""
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex[:12]}-{name}"
        try:
            with self.fs.open(tmp, "wb") as fh:
                result = write(fh)
            self.fs.mv(tmp, path)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            raise
        return result

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        metadata: dict[str, str] | None = None,
    ) -> PublishedWeights:
        """Write ``named_tensors`` as version ``version``: shards first, the manifest last, then prune old
        versions. Re-publishing an existing version replaces it (its manifest is removed first, so readers see
        either the old complete version, none, or the new complete one)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        named = list(named_tensors)
        if not named:
            raise ValueError("no tensors to publish")
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the weights to publish")
        vdir = self._version_dir(version)
        if self.fs.exists(vdir):
            manifest_path = f"{vdir}/{MANIFEST_NAME}"
            if self.fs.exists(manifest_path):
                self.fs.rm(manifest_path)
            self.fs.rm(vdir, recursive=True)
        self.fs.makedirs(vdir, exist_ok=True)

        plan = _plan_shards(named, self.max_shard_bytes)

        def write_shard(i: int, items: list[tuple[str, torch.Tensor]]) -> ShardEntry:
            cpu = _cpu_tensors(items)
            file = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
            nbytes, digest = self._write_atomic(
                f"{vdir}/{file}", lambda fh: write_safetensors(fh, cpu, {"format": "pt"})
            )
            return ShardEntry(file, nbytes, digest, tuple(cpu))

        # shards are written (and hashed) on a few threads: file I/O and sha256 both release the GIL
        with ThreadPoolExecutor(max_workers=min(len(plan), _io_threads())) as pool:
            shards = list(pool.map(write_shard, range(1, len(plan) + 1), plan))
        tensors = {
            name: TensorEntry(_dtype_name(t.dtype), tuple(t.shape)) for items in plan for name, t in items
        }
        manifest = Manifest(
            version=version,
            shards=tuple(shards),
            tensors=tensors,
            sha256=content_sha256(s.sha256 for s in shards),
            total_bytes=sum(s.nbytes for s in shards),
            created_at=now_ms(),
            metadata=dict(metadata or {}),
        )
        body = manifest.to_json()
        self._write_atomic(f"{vdir}/{MANIFEST_NAME}", lambda fh: fh.write(body))
        uri = self.manifest_uri(version)
        logger.info("published weights v%d: %d shards, %d bytes -> %s", version, len(shards), manifest.total_bytes, uri)
        self.prune()
        return PublishedWeights(uri, hashlib.sha256(body).hexdigest(), manifest.total_bytes)

    def _version_dirs(self) -> dict[int, str]:
        if not self.fs.exists(self.root):
            return {}
        found = {}
        for path in self.fs.ls(self.root, detail=False):
            match = _VERSION_DIR.match(path.rstrip("/").rpartition("/")[2])
            if match:
                found[int(match.group(1))] = path
        return found

    def versions(self) -> list[int]:
        """Complete versions (manifest present), oldest first."""
        dirs = self._version_dirs()
        return sorted(v for v, path in dirs.items() if self.fs.exists(f"{path.rstrip('/')}/{MANIFEST_NAME}"))

    def prune(self) -> list[int]:
        """Delete every version directory older than the ``keep_last`` newest complete versions (incomplete
        leftovers of a crashed publish included); returns the deleted versions."""
        complete = self.versions()
        if len(complete) <= self.keep_last:
            return []
        oldest_kept = complete[-self.keep_last]
        removed = []
        for version, path in sorted(self._version_dirs().items()):
            if version < oldest_kept:
                self.fs.rm(path, recursive=True)
                removed.append(version)
        if removed:
            logger.info("pruned weight versions %s (keeping the last %d)", removed, self.keep_last)
        return removed


def read_manifest(
    uri: str, expected_sha256: str | None = None, *, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """Read and parse a manifest; with ``expected_sha256`` (from the sync signal) verify its bytes first."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    body = fs.cat_file(path)
    if expected_sha256 is not None:
        actual = hashlib.sha256(body).hexdigest()
        if actual != expected_sha256:
            raise ManifestIntegrityError(uri, expected_sha256, actual)
    manifest = Manifest.from_json(body, uri)
    if content_sha256(s.sha256 for s in manifest.shards) != manifest.sha256:
        raise WeightFormatError(f"manifest {uri}: its sha256 of the whole does not match its shard digests")
    return manifest


def _map_local_shard(path: str, shard: ShardEntry) -> torch.Tensor:
    """Local files: a private (copy-on-write) memory map, hashed in one pass. Publishers never rewrite a file
    in place (temporary name, then move), so the mapped bytes stay the verified ones; writes to the tensors
    stay in this process."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise ShardIntegrityError(path, shard.sha256, "<missing>", shard.nbytes, 0) from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise ShardIntegrityError(path, shard.sha256, hashlib.sha256(b"").hexdigest(), shard.nbytes, 0)
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    actual = hashlib.sha256(mapped).hexdigest()
    if size != shard.nbytes or actual != shard.sha256:
        mapped.close()
        raise ShardIntegrityError(path, shard.sha256, actual, shard.nbytes, size)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _read_shard(fs, directory: str, shard: ShardEntry) -> torch.Tensor:
    """The shard's bytes as a uint8 tensor, verified: raises ShardIntegrityError unless size and sha256 match
    the manifest. Local files are memory-mapped; other filesystems are read once into one buffer, hashing each
    chunk on a background thread while the next is read."""
    path = f"{directory}/{shard.file}"
    if isinstance(fs, LocalFileSystem):
        return _map_local_shard(path, shard)
    buf = torch.empty(shard.nbytes, dtype=torch.uint8)  # not zero-filled: the read is its first touch
    view = memoryview(buf.numpy())
    digest = OverlappedSha256()
    size = 0
    try:
        with fs.open(path, "rb") as fh:
            while size < shard.nbytes:
                n = fh.readinto(view[size : size + CHUNK_BYTES])
                if not n:
                    break
                digest.update(view[size : size + n])
                size += n
            extra = fh.read() if size == shard.nbytes else b""
    except FileNotFoundError:
        digest.close()
        raise ShardIntegrityError(path, shard.sha256, "<missing>", shard.nbytes, 0) from None
    except BaseException:
        digest.close()
        raise
    digest.update(extra)
    size += len(extra)
    actual = digest.hexdigest()
    if size != shard.nbytes or actual != shard.sha256:
        raise ShardIntegrityError(path, shard.sha256, actual, shard.nbytes, size)
    return buf


def _shard_tensors(manifest: Manifest, shard: ShardEntry, data: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
    try:
        tensors = read_safetensors(data)
    except SafetensorsFormatError as exc:
        raise WeightFormatError(f"shard {path}: {exc}") from exc
    if set(tensors) != set(shard.tensors):
        raise WeightFormatError(f"shard {path} holds {sorted(tensors)}, the manifest lists {sorted(shard.tensors)}")
    for name, t in tensors.items():
        entry = manifest.tensors[name]
        if _dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
            raise WeightFormatError(
                f"tensor {name} in {path} is {_dtype_name(t.dtype)}{list(t.shape)}, "
                f"the manifest says {entry.dtype}{list(entry.shape)}"
            )
    return tensors


def iter_weights(
    uri: str,
    expected_sha256: str | None = None,
    *,
    device: torch.device | str = "cpu",
    storage_options: dict[str, Any] | None = None,
    prefetch: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` shard by shard, in manifest order. The next few shards are read and verified
    on background threads while the current one is consumed (memory: about ``prefetch + 1`` shards; a shard's
    tensors are views over the buffer it was read into). Each shard is verified before any of its tensors is
    yielded — but earlier shards have already been handed out when a later one fails; use
    :func:`load_weights` to verify everything before loading anything."""
    manifest = read_manifest(uri, expected_sha256, storage_options=storage_options)
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    directory = path.rpartition("/")[0]
    prefetch = prefetch if prefetch is not None else _io_threads()
    pending: deque[tuple[ShardEntry, Future]] = deque()
    shards = iter(manifest.shards)
    with ThreadPoolExecutor(max_workers=max(1, prefetch)) as pool:
        try:
            while True:
                while len(pending) < max(1, prefetch):
                    shard = next(shards, None)
                    if shard is None:
                        break
                    pending.append((shard, pool.submit(_read_shard, fs, directory, shard)))
                if not pending:
                    return
                shard, future = pending.popleft()
                tensors = _shard_tensors(manifest, shard, future.result(), f"{directory}/{shard.file}")
                for name in shard.tensors:
                    yield name, tensors[name].to(device)
        finally:
            for _, future in pending:
                future.cancel()


def load_weights(
    uri: str,
    expected_sha256: str | None = None,
    *,
    device: torch.device | str = "cpu",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a published version, in manifest order, after every shard verified (all or nothing)."""
    return dict(iter_weights(uri, expected_sha256, device=device, storage_options=storage_options))
