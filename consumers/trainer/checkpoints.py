"""Trainer checkpoints (model, optimizer, step, consumed offsets, buffered experiences), written atomically,
and the audit of which experiences each step trained."""
from __future__ import annotations

import base64
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from streamrft.errors import ConfigError
from streamrft.kafka.consumer import Offsets
from streamrft.schemas import now_ms


CHECKPOINT_FORMAT = "streamrft.trainer-checkpoint/1"
AUDIT_NAME = "trained.jsonl"


@dataclass
class Checkpoint:
    path: Path
    step: int
    offsets: Offsets
    buffered: list[dict]  # {"topic", "partition", "offset", "timestamp_ms", "value" (encoded bytes)}
    has_model: bool
    meta: dict


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Checkpoints:
    """One trainer lineage's directory: ``step-NNNNNNNN/`` checkpoints (each written to a temporary directory,
    then renamed into place, so one that exists is complete), and the audit ``trained.jsonl``."""

    def __init__(self, root: Path, keep: int):
        self.root = Path(root)
        self.keep = keep
        self.audit_path = self.root / AUDIT_NAME

    def _complete(self) -> dict[int, Path]:
        if not self.root.is_dir():
            return {}
        found = {}
        for path in self.root.iterdir():
            if path.is_dir() and path.name.startswith("step-") and (path / "state.json").is_file():
                try:
                    found[int(path.name.removeprefix("step-"))] = path
                except ValueError:
                    continue
        return found

    def steps(self) -> list[int]:
        return sorted(self._complete())

    def paths(self) -> dict[int, Path]:
        """The complete checkpoints by step."""
        return dict(sorted(self._complete().items()))

    def latest(self) -> Path | None:
        found = self._complete()
        return found[max(found)] if found else None

    def save(self, step: int, write_engine: Callable[[Path], None] | None, offsets: Offsets,
             buffered: list[dict], meta: dict) -> Path:
        """``write_engine(directory)`` writes the training engine's state into the new checkpoint (on every rank
        of a distributed trainer: the directory must be shared by them); None: a checkpoint of offsets only."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if write_engine is not None:
                write_engine(tmp)
            with open(tmp / "buffer.jsonl", "w") as fh:
                for entry in buffered:
                    fh.write(json.dumps({**entry, "value": base64.b64encode(entry["value"]).decode()}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            state = {"format": CHECKPOINT_FORMAT, "step": step, "has_model": write_engine is not None,
                     "offsets": [[t, p, o] for (t, p), o in sorted(offsets.items())], "buffered": len(buffered),
                     "created_at": now_ms(), **meta}
            with open(tmp / "state.json", "w") as fh:  # last: the marker of a complete checkpoint
                json.dump(state, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def load(self, path: Path) -> Checkpoint:
        """The checkpoint's step, offsets, buffer and meta; its engine state (``has_model``) is the engine's to
        read from ``path`` (``TrainingEngine.load_state``)."""
        state = json.loads((path / "state.json").read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(f"{path} is not a trainer checkpoint ({state.get('format')!r}, expected "
                              f"{CHECKPOINT_FORMAT!r})")
        buffered = []
        with open(path / "buffer.jsonl") as fh:
            for line in fh:
                entry = json.loads(line)
                entry["value"] = base64.b64decode(entry["value"])
                buffered.append(entry)
        meta = {k: v for k, v in state.items() if k not in ("offsets", "step", "has_model")}
        offsets = {(t, int(p)): int(o) for t, p, o in state["offsets"]}
        return Checkpoint(path, int(state["step"]), offsets, buffered, bool(state["has_model"]), meta)

    def prune(self) -> None:
        """Keep the newest ``keep`` checkpoints; remove leftovers of interrupted saves."""
        found = self._complete()
        for step in sorted(found)[: -self.keep]:
            shutil.rmtree(found[step], ignore_errors=True)
        for path in self.root.glob(".tmp-step-*"):
            shutil.rmtree(path, ignore_errors=True)

    # -- the audit ------------------------------------------------------------------------------------------
    def record(self, step: int, version: int, eids: list[str], dropped_stale: list[str],
               staleness: list[int] | None = None) -> None:
        """Append one step's trained eids (flushed before the step's offsets are committed): trainer step
        ``step`` (0-based, as in the metrics) produced weights ``version``; ``staleness[i]``: how many versions
        older than the trained weights ``eids[i]``'s oldest token was."""
        self.root.mkdir(parents=True, exist_ok=True)
        entry = {"step": step, "version": version, "eids": eids, "dropped_stale": dropped_stale}
        if staleness is not None:
            entry["staleness"] = staleness
        line = json.dumps(entry, separators=(",", ":"))
        with open(self.audit_path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def truncate_audit(self, version: int) -> int:
        """Keep the entries of the steps that a checkpoint of weights ``version`` holds (the surviving lineage);
        a torn last line goes too. Returns how many entries were removed."""
        if not self.audit_path.exists():
            return 0
        kept, removed = [], 0
        for line in self.audit_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                removed += 1
                continue
            if entry["version"] <= version:
                kept.append(line)
            else:
                removed += 1
        tmp = self.audit_path.with_name(f".{AUDIT_NAME}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.audit_path)
        return removed

    def audit(self) -> list[dict]:
        """The audit entries (a torn last line, from a process killed mid-write, is skipped)."""
        if not self.audit_path.exists():
            return []
        entries = []
        for line in self.audit_path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
        return entries


