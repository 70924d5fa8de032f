"""Trainer checkpoints on an object store (``trainer.checkpoint_dir: s3://bucket/prefix``), with the local
directory's guarantee: a checkpoint is visible only once complete. S3 has no rename, so each checkpoint is staged
in a local directory (the engine's ``torch.save`` needs one), uploaded under a prefix of its own
(``data/step-NNNNNNNN-<id>/``), and then a small manifest ``step-NNNNNNNN.json`` is written last: readers list
only manifests, so an upload cut short is never read, and the next save removes it. The audit (``trained.jsonl``)
is kept locally and travels inside each checkpoint, so a trainer on a fresh machine resumes with its lineage's
audit up to that step."""
from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec

from streamrft.engines.weights.store_access import store_access
from streamrft.errors import ConfigError
from streamrft.kafka.consumer import Offsets

from .checkpoints import AUDIT_NAME, CHECKPOINT_FORMAT, Checkpoint, Checkpoints

MANIFEST_FORMAT = "streamrft.trainer-checkpoint-manifest/1"


class RemoteCheckpoints(Checkpoints):
    """The checkpoints of one lineage at ``url`` (any fsspec URL; s3:// in practice), staged in ``staging``."""

    def __init__(self, url: str, keep: int, storage_options: dict[str, Any] | None = None,
                 staging: Path | None = None):
        super().__init__(staging or Path(tempfile.mkdtemp(prefix="streamrft-checkpoints-")), keep)
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        with self._access():
            self.fs, self.remote = fsspec.core.url_to_fs(self.url, **self.storage_options)

    def _access(self):
        return store_access(self.url, self.storage_options)

    def _manifests(self) -> dict[int, str]:
        with self._access():
            try:
                names = self.fs.ls(self.remote, detail=False, refresh=True)
            except FileNotFoundError:
                return {}
        found = {}
        for name in names:
            base = PurePosixPath(name).name
            if base.startswith("step-") and base.endswith(".json"):
                try:
                    found[int(base.removeprefix("step-").removesuffix(".json"))] = name
                except ValueError:
                    continue
        return found

    def steps(self) -> list[int]:
        return sorted(self._manifests())

    def paths(self) -> dict[int, PurePosixPath]:
        return {step: PurePosixPath(name) for step, name in sorted(self._manifests().items())}

    def latest(self) -> PurePosixPath | None:
        found = self._manifests()
        return PurePosixPath(found[max(found)]) if found else None

    def save(self, step: int, write_engine: Callable[[Path], None] | None, offsets: Offsets,
             buffered: list[dict], meta: dict) -> PurePosixPath:
        local = super().save(step, write_engine, offsets, buffered, meta)  # complete and atomic on local disk
        if self.audit_path.exists():
            shutil.copy(self.audit_path, local / AUDIT_NAME)
        data = f"data/{local.name}-{uuid.uuid4().hex[:8]}"
        files = {str(p.relative_to(local)): p.stat().st_size for p in sorted(local.rglob("*")) if p.is_file()}
        with self._access():
            for name in files:
                self.fs.put_file(str(local / name), f"{self.remote}/{data}/{name}")
            manifest = {"format": MANIFEST_FORMAT, "step": step, "data": data, "files": files}
            self.fs.pipe_file(f"{self.remote}/{local.name}.json", json.dumps(manifest, indent=1).encode())
        self.prune()
        return PurePosixPath(f"{self.remote}/{local.name}.json")

    def load(self, path: PurePosixPath | Path) -> Checkpoint:
        """Download the checkpoint ``path`` (a manifest) into the staging directory, check every file arrived
        whole, take its audit as this lineage's, and read it as a local one."""
        with self._access():
            manifest = json.loads(self.fs.cat_file(str(path)))
            if manifest.get("format") != MANIFEST_FORMAT:
                raise ConfigError(f"{self.url}/{PurePosixPath(path).name} is not a trainer checkpoint manifest "
                                  f"({manifest.get('format')!r}, expected {MANIFEST_FORMAT!r})")
            local = self.root / f"step-{int(manifest['step']):08d}"
            shutil.rmtree(local, ignore_errors=True)
            for name, size in manifest["files"].items():
                target = local / name
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{self.remote}/{manifest['data']}/{name}", str(target))
                if target.stat().st_size != size:
                    raise ConfigError(f"{self.url}: {manifest['data']}/{name} has {target.stat().st_size} bytes, "
                                      f"its manifest says {size}: the store changed under the checkpoint; remove "
                                      f"{PurePosixPath(path).name} to resume from the one before")
        if (local / AUDIT_NAME).exists():
            shutil.copy(local / AUDIT_NAME, self.audit_path)
        return super().load(local)

    def prune(self) -> None:
        """Keep the newest ``keep`` checkpoints; remove the data of older ones and of uploads cut short (a data
        prefix no manifest names)."""
        super().prune()
        manifests = self._manifests()
        with self._access():
            for step in sorted(manifests)[: -self.keep]:
                self.fs.rm_file(manifests.pop(step))
            named = {json.loads(self.fs.cat_file(m))["data"].rsplit("/", 1)[-1] for m in manifests.values()}
            try:
                prefixes = self.fs.ls(f"{self.remote}/data", detail=False, refresh=True)
            except FileNotFoundError:
                prefixes = []
            for prefix in prefixes:
                if PurePosixPath(prefix).name not in named:
                    self.fs.rm(prefix, recursive=True)


__all__ = ["CHECKPOINT_FORMAT", "RemoteCheckpoints"]
