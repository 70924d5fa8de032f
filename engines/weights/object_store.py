"""Weight publishing through any fsspec URL (a local directory by default; ``s3://``, ``gs://``, ... with the
matching fsspec backend installed).

Layout under the base URL::

    v00000007-20250101T120000-1a2b3c4d/model-00001-of-00002.safetensors
    v00000007-20250101T120000-1a2b3c4d/model-00002-of-00002.safetensors
    v00000007-20250101T120000-1a2b3c4d/manifest.json   <- written last; its presence means the version is complete

The directory is the version plus the publisher's *lineage* (one id per trainer lifetime, see
:func:`new_lineage`): a trainer that resumes from an older checkpoint publishes versions it published before,
and they must not overwrite (or be pruned as older than) the lost ones. A store without a lineage (tests,
benchmarks, older publishers) writes plain ``v00000007``.

Shards are size-bounded safetensors files. The manifest lists, per shard, its file name, byte size, BLAKE3
digest and tensor names; per tensor its dtype and shape; and ``blake3`` of the whole, defined as
``blake3(concat(raw digest of each shard, in order))`` — it changes iff any shard's content changes; and the
version and lineage it holds, which a reader compares with the announcement. The manifest itself is announced
by its sha256 (the ``SyncSignal`` field).
Each file is written under a temporary name and then moved into place, so a reader never sees half a file.
:meth:`ObjectStore.publish` returns ``(manifest uri, sha256 of the manifest bytes, total shard bytes)`` — what a
``SyncSignal(WEIGHTS_PUBLISHED)`` carries; a reader passes that sha256 (required) back to :func:`load_weights`,
which verifies the manifest, then every shard, and raises :class:`ShardIntegrityError` naming a bad shard.
:func:`check_manifest_uri` tells whether an announced URI is a version directory of a given store at all.

Cost: the bytes are written and read once each (local shards are memory-mapped on load), each hashed on the
same pass. Shards are hashed with BLAKE3 on every core: sha256 was the bound (1.6 GB/s on this project's 2-core
machine, one pass per side: more than a raw safetensors save + load of the same bytes), BLAKE3 runs at 11 GB/s.
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

from .errors import (
    ChecksumRequiredError,
    ManifestIntegrityError,
    ManifestMismatchError,
    ShardIntegrityError,
    UnsafeShardNameError,
    WeightFormatError,
)
from .store_access import guarded, store_access
from .locations import (
    HEX256,
    MANIFEST_NAME,
    check_lineage,
    is_sha256,
    parse_version_dir,
    version_dir_name,
)
from .safetensors_io import (
    CHUNK_BYTES,
    SafetensorsFormatError,
    digest_of,
    new_digest,
    read_safetensors,
    write_safetensors,
)

logger = logging.getLogger(__name__)

FORMAT = "streamrft.weights/2"  # /1 had sha256 shard digests
DEFAULT_MAX_SHARD_BYTES = 256 << 20  # small enough to hash several shards in parallel and bound memory
_SHARD_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")  # a plain name: no '/', no leading '.'


class PublishedWeights(NamedTuple):
    uri: str  # of the manifest
    sha256: str  # of the manifest bytes
    nbytes: int  # total bytes of the shards


@dataclass(frozen=True)
class ShardEntry:
    file: str
    nbytes: int
    blake3: str
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
    blake3: str  # of the whole: BLAKE3 over the shards' raw digests, in order
    total_bytes: int
    created_at: int
    metadata: dict[str, str]
    lineage: str = ""

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "lineage": self.lineage,
            "created_at": self.created_at,
            "total_bytes": self.total_bytes,
            "blake3": self.blake3,
            "metadata": self.metadata,
            "shards": [
                {"file": s.file, "nbytes": s.nbytes, "blake3": s.blake3, "tensors": list(s.tensors)}
                for s in self.shards
            ],
            "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in self.tensors.items()},
        }
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, uri: str = "") -> "Manifest":
        """Parse and check the structure: every number a non-negative integer, every shard a plain file name in
        the manifest's own directory, every tensor in exactly one shard. Anything else is a WeightFormatError
        (never a KeyError or OverflowError from deep inside a load)."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
                raise WeightFormatError(f"manifest {uri}: format {found!r}, expected {FORMAT!r}")
            manifest = cls(
                version=_count(doc["version"], "version"),
                shards=tuple(_shard_entry(s, uri) for s in doc["shards"]),
                tensors={str(n): TensorEntry(str(t["dtype"]), tuple(_count(d, f"{n} shape") for d in t["shape"]))
                         for n, t in doc["tensors"].items()},
                blake3=str(doc["blake3"]),
                total_bytes=_count(doc["total_bytes"], "total_bytes"),
                created_at=_count(doc["created_at"], "created_at"),
                metadata={str(k): str(v) for k, v in doc.get("metadata", {}).items()},
                lineage=check_lineage(str(doc.get("lineage", ""))),
            )
        except WeightFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
            raise WeightFormatError(f"manifest {uri} is not a valid {FORMAT} manifest: {exc!r}") from exc
        listed = [name for shard in manifest.shards for name in shard.tensors]
        if len(listed) != len(set(listed)) or set(listed) != set(manifest.tensors):
            raise WeightFormatError(f"manifest {uri}: its shards' tensor lists do not match its tensor table "
                                    "one to one")
        return manifest


def _count(value: object, what: str) -> int:
    """A JSON integer >= 0 (not a bool, not a float like 1e400)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return value


def _shard_entry(doc: dict, uri: str) -> ShardEntry:
    file = doc["file"]
    # a shard is read as <manifest's directory>/<file>: a '/' or '..' would read outside the version
    if not isinstance(file, str) or not _SHARD_FILE.match(file) or ".." in file:
        raise UnsafeShardNameError(f"manifest {uri}: shard file {file!r} is not a plain file name in the "
                                   "manifest's directory; refusing it")
    if not HEX256.match(str(doc["blake3"])):
        raise ValueError(f"shard {file}: blake3 {doc['blake3']!r} is not 64 hex digits")
    return ShardEntry(file, _count(doc["nbytes"], f"{file} nbytes"), doc["blake3"],
                      tuple(str(n) for n in doc["tensors"]))


def content_digest(shard_digests: Iterable[str]) -> str:
    """The manifest's ``blake3`` of the whole: BLAKE3 over the shards' raw digests, in order."""
    return digest_of(b"".join(bytes.fromhex(d) for d in shard_digests))


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
    """Versioned weight snapshots of one lineage under an fsspec base URL, keeping the newest ``keep_last``
    (see :meth:`prune` for versions of other lineages in the same place)."""

    def __init__(
        self,
        url: str,
        *,
        lineage: str = "",
        keep_last: int = 3,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.url = url
        self.lineage = check_lineage(lineage)
        self.keep_last = keep_last
        self.max_shard_bytes = max_shard_bytes
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)

    def _version_dir(self, version: int, lineage: str | None = None) -> str:
        name = version_dir_name(version, self.lineage if lineage is None else lineage)
        return f"{self.root.rstrip('/')}/{name}"

    def manifest_path(self, version: int, lineage: str | None = None) -> str:
        """Where the manifest of ``version`` of ``lineage`` (default: this store's) lives, protocol stripped."""
        return f"{self._version_dir(version, lineage)}/{MANIFEST_NAME}"

    def manifest_uri(self, version: int, lineage: str | None = None) -> str:
        return self.fs.unstrip_protocol(self.manifest_path(version, lineage))

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

    @guarded
    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        metadata: dict[str, str] | None = None,
    ) -> PublishedWeights:
        """Write ``named_tensors`` as version ``version`` of this store's lineage: shards first, the manifest
        last, then prune old versions. Re-publishing a version of the same lineage replaces it (its manifest is
        removed first, so readers see either the old complete version, none, or the new complete one); the
        same version of another lineage is another directory and stays."""
        version_dir_name(version)  # raises for a negative or non-integer version
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

        # shards are written (and hashed) on a few threads: file I/O releases the GIL
        with ThreadPoolExecutor(max_workers=min(len(plan), _io_threads())) as pool:
            shards = list(pool.map(write_shard, range(1, len(plan) + 1), plan))
        tensors = {
            name: TensorEntry(_dtype_name(t.dtype), tuple(t.shape)) for items in plan for name, t in items
        }
        manifest = Manifest(
            version=version,
            shards=tuple(shards),
            tensors=tensors,
            blake3=content_digest(s.blake3 for s in shards),
            total_bytes=sum(s.nbytes for s in shards),
            created_at=now_ms(),
            metadata=dict(metadata or {}),
            lineage=self.lineage,
        )
        body = manifest.to_json()
        self._write_atomic(f"{vdir}/{MANIFEST_NAME}", lambda fh: fh.write(body))
        uri = self.manifest_uri(version)
        logger.info("published weights v%d (lineage %r): %d shards, %d bytes -> %s", version, self.lineage,
                    len(shards), manifest.total_bytes, uri)
        self.prune()
        return PublishedWeights(uri, hashlib.sha256(body).hexdigest(), manifest.total_bytes)

    def _version_dirs(self) -> dict[tuple[str, int], str]:
        """Every version directory under the base URL, complete or not: ``{(lineage, version): path}``."""
        if not self.fs.exists(self.root):
            return {}
        found = {}
        for path in self.fs.ls(self.root, detail=False):
            key = parse_version_dir(path.rstrip("/").rpartition("/")[2])
            if key is not None:
                found[key] = path.rstrip("/")
        return found

    def _is_complete(self, path: str) -> bool:
        return self.fs.exists(f"{path}/{MANIFEST_NAME}")

    def _created_at(self, path: str) -> int:
        """When a complete version was published (its manifest's ``created_at``); 0 if unreadable."""
        try:
            return int(json.loads(self.fs.cat_file(f"{path}/{MANIFEST_NAME}")).get("created_at", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    @guarded
    def versions(self) -> list[int]:
        """Complete versions of this store's lineage (manifest present), oldest first."""
        return sorted(v for (lineage, v), path in self._version_dirs().items()
                      if lineage == self.lineage and self._is_complete(path))

    @guarded
    def lineages_of(self, version: int) -> list[str]:
        """The lineages that hold a complete ``version``, oldest trainer first (:func:`new_lineage` order)."""
        return sorted(lineage for (lineage, v), path in self._version_dirs().items()
                      if v == version and self._is_complete(path))

    @guarded
    def prune(self) -> list[str]:
        """Delete old version directories; returns the names deleted.

        ``keep_last`` counts this lineage's newest complete versions first — the newest one is never deleted —
        and the remaining places go to older lineages' complete versions, most recently published first, so a
        resumed trainer's fresh v3 is kept over the lost lineage's v7. Lineage ids order by the trainer's start
        (:func:`new_lineage`; ``""`` first): a lineage that sorts after this one belongs to a newer trainer
        (this one is a leftover that has not noticed yet) and is left alone. Incomplete directories (a crashed
        publish) go when they are of this lineage and older than what it keeps, or of an older lineage."""
        dirs = self._version_dirs()
        mine = sorted(v for (lineage, v), path in dirs.items() if lineage == self.lineage and self._is_complete(path))
        keep = {(self.lineage, v) for v in mine[-self.keep_last:]}
        older = sorted((self._created_at(path), key) for key, path in dirs.items()
                       if key[0] < self.lineage and self._is_complete(path))
        room = self.keep_last - len(keep)
        if room > 0:
            keep.update(key for _, key in older[-room:])
        oldest_kept = mine[-self.keep_last:][0] if mine else -1
        removed = []
        for key, path in sorted(dirs.items()):
            lineage, version = key
            if key in keep or lineage > self.lineage:
                continue
            if lineage == self.lineage and version >= oldest_kept:
                continue  # an incomplete directory newer than what this lineage keeps
            self.fs.rm(path, recursive=True)
            removed.append(path.rpartition("/")[2])
        if removed:
            logger.info("pruned weight versions %s (keeping the last %d, lineage %r first)", removed,
                        self.keep_last, self.lineage)
        return removed


def read_manifest(
    uri: str,
    expected_sha256: str,
    *,
    expected_version: int | None = None,
    expected_lineage: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Read a manifest, verify its bytes against ``expected_sha256`` (from the announcement; required), parse
    it, and check it describes ``expected_version`` / ``expected_lineage`` when given (ManifestMismatchError)."""
    if not is_sha256(expected_sha256):
        raise ChecksumRequiredError(uri, expected_sha256)
    with store_access(uri, storage_options):
        fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        body = fs.cat_file(path)
    actual = hashlib.sha256(body).hexdigest()
    if actual != expected_sha256:
        raise ManifestIntegrityError(uri, expected_sha256, actual)
    manifest = Manifest.from_json(body, uri)
    if content_digest(s.blake3 for s in manifest.shards) != manifest.blake3:
        raise WeightFormatError(f"manifest {uri}: its digest of the whole does not match its shard digests")
    if expected_version is not None and manifest.version != expected_version:
        raise ManifestMismatchError(f"manifest {uri} is of version {manifest.version}, announced as "
                                    f"v{expected_version}")
    if expected_lineage is not None and manifest.lineage != expected_lineage:
        raise ManifestMismatchError(f"manifest {uri} is of lineage {manifest.lineage!r}, announced as "
                                    f"{expected_lineage!r}")
    return manifest


def _map_local_shard(path: str, shard: ShardEntry) -> torch.Tensor:
    """Local files: a private (copy-on-write) memory map, hashed in one pass. Publishers never rewrite a file
    in place (temporary name, then move), so the mapped bytes stay the verified ones; writes to the tensors
    stay in this process."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise ShardIntegrityError(path, shard.blake3, "<missing>", shard.nbytes, 0) from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise ShardIntegrityError(path, shard.blake3, digest_of(b""), shard.nbytes, 0)
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    actual = digest_of(mapped)
    if size != shard.nbytes or actual != shard.blake3:
        mapped.close()
        raise ShardIntegrityError(path, shard.blake3, actual, shard.nbytes, size)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _read_shard(fs, directory: str, shard: ShardEntry) -> torch.Tensor:
    """The shard's bytes as a uint8 tensor, verified: raises ShardIntegrityError unless size and digest match
    the manifest. Local files are memory-mapped; other filesystems are read once into one buffer, each chunk
    hashed as it arrives."""
    path = f"{directory}/{shard.file}"
    if isinstance(fs, LocalFileSystem):
        return _map_local_shard(path, shard)
    buf = torch.empty(shard.nbytes, dtype=torch.uint8)  # not zero-filled: the read is its first touch
    view = memoryview(buf.numpy())
    digest = new_digest()
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
        raise ShardIntegrityError(path, shard.blake3, "<missing>", shard.nbytes, 0) from None
    digest.update(extra)
    size += len(extra)
    actual = digest.hexdigest()
    if size != shard.nbytes or actual != shard.blake3:
        raise ShardIntegrityError(path, shard.blake3, actual, shard.nbytes, size)
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
    expected_sha256: str,
    *,
    expected_version: int | None = None,
    expected_lineage: str | None = None,
    device: torch.device | str = "cpu",
    storage_options: dict[str, Any] | None = None,
    prefetch: int | None = None,
    manifest: Manifest | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` shard by shard, in manifest order. The next few shards are read and verified
    on background threads while the current one is consumed (memory: about ``prefetch + 1`` shards; a shard's
    tensors are views over the buffer it was read into). Each shard is verified before any of its tensors is
    yielded — but earlier shards have already been handed out when a later one fails; use
    :func:`load_weights` to verify everything before loading anything. ``manifest``: one already read with
    :func:`read_manifest` from this ``uri`` (its checks are not repeated)."""
    if manifest is None:
        manifest = read_manifest(uri, expected_sha256, expected_version=expected_version,
                                 expected_lineage=expected_lineage, storage_options=storage_options)
    with store_access(uri, storage_options):
        yield from _iter_shards(uri, manifest, device, storage_options,
                                prefetch if prefetch is not None else _io_threads())


def _iter_shards(uri: str, manifest: Manifest, device: torch.device | str, storage_options: dict[str, Any] | None,
                 prefetch: int) -> Iterator[tuple[str, torch.Tensor]]:
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    directory = path.rpartition("/")[0]
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
    expected_sha256: str,
    *,
    expected_version: int | None = None,
    expected_lineage: str | None = None,
    device: torch.device | str = "cpu",
    storage_options: dict[str, Any] | None = None,
    manifest: Manifest | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a published version, in manifest order, after every shard verified (all or nothing)."""
    return dict(iter_weights(uri, expected_sha256, expected_version=expected_version,
                             expected_lineage=expected_lineage, device=device, storage_options=storage_options,
                             manifest=manifest))
