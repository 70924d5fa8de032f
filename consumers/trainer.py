"""The trainer: turns experiences into weight updates. One instance per consumer group (``<run>.trainer``; a
replay / fan-out trainer takes a group of its own with ``--group``).

Each pass of ``run``, read as numbered steps:
1. poll ``experiences`` (read_committed) into the group buffer (one GRPO group = one ``group_id``);
2. drop groups still incomplete after ``group_timeout_s``;
3. pick a batch: ``groups_per_train_step`` complete groups, oldest ``batch_id`` first — or a short batch once
   the explorer has finished every step in the buffer and everything it wrote is read (failed or cancelled
   tasks leave a step with fewer groups; waiting for them would deadlock ``fixed`` pacing);
4. apply the staleness bound (drop or importance-correct), run one optimiser step, note the eids in the audit;
5. every ``explorer.sync_interval`` steps publish the weights — upload first, then ``WEIGHTS_PUBLISHED``;
6. in ONE transaction: the step's metrics (and the signal); then commit the trained-through offsets, so the
   explorer's lag-based backpressure counts what is still untrained (buffered records stay uncommitted);
7. every ``save_interval`` steps checkpoint: model, optimiser, scheduler, step, the consumed offsets and the
   buffered-but-untrained experiences, written atomically.

Resume loads the newest checkpoint, seeks to *its* offsets (not the group's committed ones) and restores its
buffer, so nothing is trained twice or skipped; ``trained.jsonl`` in the checkpoint directory lists the eids of
every step of the surviving lineage.

Numbering: trainer step ``t`` (0-based: the ``step`` of its metrics and audit line) produces weights version
``t + 1`` — versions count the steps trained into the weights — and, under ``fixed`` pacing, trains explorer
step ``t``'s experiences, so the monitor's rows line up. Checkpoint ``step-N`` (and the audit's ``version``)
holds N steps.

Weight transports (``trainer.weights.method``):

* ``object_store``: safetensors shards + manifest under ``weights_url``; the signal carries the manifest URI and
  sha256, and rollout workers verify before they swap.
* ``collective``: torch.distributed broadcast (gloo on CPU, NCCL on GPU). Rendezvous through ``sync``:
  the trainer hosts a small rank-claim store and publishes ``NCCL_READY`` (uri = the group's ``tcp://``
  address; state = ``{"world_size", "claim", "session", "bucket_bytes"}``); each receiver claims a rank
  1..N−1 from the claim store and joins; the trainer (rank 0) joins in the background and, at each sync,
  broadcasts the weights and only then publishes ``WEIGHTS_PUBLISHED(method=COLLECTIVE)``. Receivers take every
  broadcast on a background thread (:class:`CollectiveReceiver`) and swap between tasks. At the end the trainer
  broadcasts an empty version −1, which tells receivers to leave.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..config import RunConfig
from ..engines.algorithms import apply_staleness
from ..engines.training import TrainingEngine, TrainingSettings
from ..engines.weights import CollectiveGroup, ObjectStore, broadcast_weights, free_port, receive_weights
from ..errors import ConfigError
from ..kafka import KafkaClients, RecordProducer, Transactor
from ..kafka.consumer import Delivered
from ..lifecycle import StopSignal
from ..schemas import Experience, RolloutKind, SingleObjectCodec, SyncKind, SyncMethod, SyncSignal, now_ms
from ..sync import SyncView
from ..telemetry import MetricsPublisher, serve_prometheus
from .model_paths import resolve_model_path

logger = logging.getLogger(__name__)

POLL_S = 0.1
PRIMARY = "trainer"  # the group whose weights the run's workers follow
CHECKPOINT_FORMAT = "streamrft.trainer-checkpoint/1"
AUDIT_NAME = "trained.jsonl"
_EPOCH_MS_FROM = 10**12  # a --replay-from integer this large is epoch milliseconds (2001 on), not an offset

Offsets = dict[tuple[str, int], int]


# ---------------------------------------------------------------------------------------------------------------
# settings derived from the run config
# ---------------------------------------------------------------------------------------------------------------
def training_settings(config: RunConfig) -> TrainingSettings:
    """The training engine's settings from the trainer and algorithm sections. The loss divides logits by the
    rollout's sampling temperature, as the engine did when it computed the behaviour logprobs."""
    t, a = config.trainer, config.trainer.algorithm
    if t.lr_schedule == "warmup_cosine" and t.total_steps is None:
        raise ConfigError("trainer.lr_schedule=warmup_cosine needs trainer.total_steps (the cosine horizon); set "
                          "it, or use lr_schedule: constant")
    temperature = config.rollout.sampling.temperature or 1.0  # greedy rollouts report T=1 logprobs
    try:
        return TrainingSettings(
            lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, lr_schedule=t.lr_schedule,
            warmup_steps=t.warmup_steps, total_steps=t.total_steps or 0, micro_batch_size=t.micro_batch_size,
            temperature=temperature, advantage=a.advantage, policy_loss=a.policy_loss, clip_low=a.clip_low,
            clip_high=a.clip_high, loss_agg=a.loss_agg, entropy_coef=a.entropy_coef, kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator, kl_penalty_coef=a.kl_penalty_coef, tis=a.tis, tis_cap=a.tis_cap,
        )
    except ValueError as exc:
        raise ConfigError(f"trainer settings: {exc}") from exc


def staleness_bound(config: RunConfig) -> int:
    """Versions an experience may lag behind the weights being trained before the staleness policy applies.

    ``fixed`` pacing lets the explorer roll out ``sync_interval`` steps on one version and run ``sync_offset``
    further ahead, so trainer step ``t`` sees experiences up to ``sync_interval − 1 + sync_offset`` versions
    old by design; the bound is never tighter than that (else ``fixed`` would drop its own batches). Other
    styles: ``explorer.max_staleness``.
    """
    e = config.explorer
    if e.sync_style == "fixed":
        return max(e.max_staleness, e.sync_interval - 1 + e.sync_offset)
    return e.max_staleness


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


# ---------------------------------------------------------------------------------------------------------------
# the group buffer (no Kafka, no torch)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Group:
    """The experiences of one ``group_id`` read so far, by eid (a redelivered duplicate is kept once)."""

    group_id: str
    batch_id: int
    size: int
    first_seen: float
    items: dict[str, Delivered[Experience]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.items) >= self.size

    @property
    def experiences(self) -> list[Experience]:
        return [item.record for item in self.items.values()]


class GroupBuffer:
    """Experiences read but not yet trained, by GRPO group, with where each came from."""

    def __init__(self, default_group_size: int):
        self.default_group_size = default_group_size
        self.groups: dict[str, Group] = {}

    def __len__(self) -> int:
        return sum(len(g.items) for g in self.groups.values())

    def add(self, item: Delivered[Experience], now: float | None = None) -> bool:
        """False when the eid is already buffered (a duplicate)."""
        exp = item.record
        group = self.groups.get(exp.group_id)
        if group is None:
            group = self.groups[exp.group_id] = Group(exp.group_id, exp.batch_id,
                                                      exp.group_size or self.default_group_size,
                                                      time.monotonic() if now is None else now)
        if exp.eid in group.items:
            return False
        group.items[exp.eid] = item
        return True

    def complete_groups(self) -> list[Group]:
        """Complete groups, oldest step first, then in arrival order."""
        return sorted((g for g in self.groups.values() if g.complete), key=lambda g: (g.batch_id, g.first_seen))

    def incomplete_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if not g.complete]

    def max_batch_id(self) -> int:
        return max((g.batch_id for g in self.groups.values()), default=-1)

    def remove(self, groups: Iterable[Group]) -> None:
        for group in groups:
            self.groups.pop(group.group_id, None)

    def expired(self, now: float, timeout_s: float) -> list[Group]:
        return [g for g in self.incomplete_groups() if now - g.first_seen >= timeout_s]

    def low_water(self) -> Offsets:
        """Per partition, the lowest offset still held (nothing before it is waiting to be trained)."""
        out: Offsets = {}
        for group in self.groups.values():
            for item in group.items.values():
                tp = (item.topic, item.partition)
                out[tp] = min(out.get(tp, item.offset), item.offset)
        return out

    def items(self) -> list[Delivered[Experience]]:
        return sorted((i for g in self.groups.values() for i in g.items.values()),
                      key=lambda i: (i.topic, i.partition, i.offset))


# ---------------------------------------------------------------------------------------------------------------
# checkpoints and the audit
# ---------------------------------------------------------------------------------------------------------------
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

    def latest(self) -> Path | None:
        found = self._complete()
        return found[max(found)] if found else None

    def save(self, step: int, engine_state: dict | None, offsets: Offsets, buffered: list[dict],
             meta: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if engine_state is not None:
                with open(tmp / "engine.pt", "wb") as fh:
                    torch.save(engine_state, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            with open(tmp / "buffer.jsonl", "w") as fh:
                for entry in buffered:
                    fh.write(json.dumps({**entry, "value": base64.b64encode(entry["value"]).decode()}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            state = {"format": CHECKPOINT_FORMAT, "step": step, "has_model": engine_state is not None,
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

    def load(self, path: Path, map_location: Any = "cpu") -> tuple[Checkpoint, dict | None]:
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
        engine_state = None
        if state["has_model"]:
            with open(path / "engine.pt", "rb") as fh:
                engine_state = torch.load(fh, map_location=map_location, weights_only=True)
        meta = {k: v for k, v in state.items() if k not in ("offsets", "step", "has_model")}
        offsets = {(t, int(p)): int(o) for t, p, o in state["offsets"]}
        return Checkpoint(path, int(state["step"]), offsets, buffered, bool(state["has_model"]), meta), engine_state

    def prune(self) -> None:
        """Keep the newest ``keep`` checkpoints; remove leftovers of interrupted saves."""
        found = self._complete()
        for step in sorted(found)[: -self.keep]:
            shutil.rmtree(found[step], ignore_errors=True)
        for path in self.root.glob(".tmp-step-*"):
            shutil.rmtree(path, ignore_errors=True)

    # -- the audit ------------------------------------------------------------------------------------------
    def record(self, step: int, version: int, eids: list[str], dropped_stale: list[str]) -> None:
        """Append one step's trained eids (flushed before the step's offsets are committed): trainer step
        ``step`` (0-based, as in the metrics) produced weights ``version``."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": step, "version": version, "eids": eids, "dropped_stale": dropped_stale},
                          separators=(",", ":"))
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


# ---------------------------------------------------------------------------------------------------------------
# weight publishing
# ---------------------------------------------------------------------------------------------------------------
class ObjectStorePublisher:
    """Uploads a version, then returns the signal that announces it (never before the upload is complete)."""

    def __init__(self, config: RunConfig, source: str):
        w = config.trainer.weights
        self.store = ObjectStore(config.weights_url, keep_last=w.keep_last, max_shard_bytes=w.shard_mb << 20)
        self.source = source

    def announcement(self) -> SyncSignal | None:
        return None

    def publish(self, engine: TrainingEngine, version: int) -> SyncSignal:
        published = self.store.publish(engine.named_weights(), version=version)
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, trainer_step=version,
                          method=SyncMethod.OBJECT_STORE, uri=published.uri, sha256=published.sha256,
                          nbytes=published.nbytes, source=self.source)

    def close(self) -> None:
        pass


class CollectivePublisher:
    """Rank 0 of the weight-sync group (see the module docstring for the rendezvous)."""

    def __init__(self, config: RunConfig, device: torch.device, source: str):
        import torch.distributed as dist

        w = config.trainer.weights
        self.host = w.collective_host
        self.world_size = 1 + w.collective_receivers
        self.timeout_s = w.collective_timeout_s
        self.bucket_bytes = w.bucket_mb << 20
        self.device = device
        self.source = source
        self.session = uuid.uuid4().hex[:12]
        group_port = w.collective_port or free_port(self.host)
        claim_port = w.collective_port + 1 if w.collective_port else free_port(self.host)
        self.address = f"tcp://{self.host}:{group_port}"
        self.claim_address = f"tcp://{self.host}:{claim_port}"
        self._claims = dist.TCPStore(self.host, claim_port, None, True,
                                     timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.group: CollectiveGroup | None = None
        self._error: BaseException | None = None
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._join, name="weight-sync-join", daemon=True)

    def announcement(self) -> SyncSignal:
        """NCCL_READY: where to join, how many, and where to claim a rank. Joining starts now."""
        if not self._thread.is_alive() and not self._joined.is_set():
            self._thread.start()
        state = {"world_size": self.world_size, "claim": self.claim_address, "session": self.session,
                 "bucket_bytes": self.bucket_bytes}
        return SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE, uri=self.address,
                          source=self.source, state=json.dumps(state))

    def _join(self) -> None:
        try:
            self.group = CollectiveGroup.join(self.address, 0, self.world_size, device=self.device,
                                              timeout_s=self.timeout_s)
        except BaseException as exc:  # surfaced at the next publish
            self._error = exc
        finally:
            self._joined.set()

    def _wait_for_group(self) -> CollectiveGroup:
        if not self._joined.wait(self.timeout_s + 5):
            raise TimeoutError("weight-sync group still forming")
        if self.group is None:
            raise RuntimeError(
                f"weights.method=collective: {self.world_size - 1} receiver(s) did not join {self.address} within "
                f"{self.timeout_s:.0f}s ({self._error}); start the inference side, raise "
                "trainer.weights.collective_timeout_s, or use method: object_store") from self._error
        return self.group

    def publish(self, engine: TrainingEngine, version: int) -> SyncSignal:
        group = self._wait_for_group()
        stats = broadcast_weights(group, engine.named_weights(), version, bucket_bytes=self.bucket_bytes)
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, trainer_step=version,
                          method=SyncMethod.COLLECTIVE, uri=self.address, nbytes=stats.nbytes, source=self.source)

    def close(self) -> None:
        if self.group is not None:
            try:
                broadcast_weights(self.group, [], -1)  # tells receivers to leave
            except Exception:
                logger.debug("farewell broadcast failed", exc_info=True)
            self.group.close()
            self.group = None
        self._claims = None


def find_collective_ready(clients: KafkaClients, timeout_s: float = 60.0, client_id: str = "collective-receiver",
                          ) -> SyncSignal:
    """The newest NCCL_READY on the run's ``sync`` topic, waiting up to ``timeout_s`` for one to appear."""
    view = SyncView(clients, client_id=client_id)
    deadline = time.monotonic() + timeout_s
    ready = None
    try:
        while True:
            for signal in view.poll(0.2):
                if signal.kind == SyncKind.NCCL_READY:
                    ready = signal
            if ready is not None and view.caught_up:
                return ready
            if time.monotonic() > deadline:
                raise TimeoutError(f"no NCCL_READY on {view.topic} after {timeout_s:.0f}s; is the trainer running "
                                   "with trainer.weights.method: collective?")
    finally:
        view.close()


class CollectiveReceiver:
    """Inference side of ``collective``: claims a rank, joins the trainer's group and receives every broadcast
    on a background thread; the owner swaps between tasks with :meth:`take` (newest version) or waits with
    :meth:`wait`. Every receiver must keep receiving (the trainer's broadcast waits for all)."""

    def __init__(self, ready: SyncSignal, *, device: torch.device | str = "cpu", rank: int | None = None,
                 timeout_s: float = 300.0):
        if ready.kind != SyncKind.NCCL_READY:
            raise ValueError(f"expected an NCCL_READY signal, got {ready.kind}")
        self.ready = ready
        self.state = json.loads(ready.state)
        self.device = torch.device(device)
        self.rank = rank
        self.timeout_s = timeout_s
        self.group: CollectiveGroup | None = None
        self.error: BaseException | None = None
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._cond = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._main, name="weight-sync-receive", daemon=True)

    def start(self) -> "CollectiveReceiver":
        self._thread.start()
        return self

    def _claim_rank(self) -> int:
        import torch.distributed as dist
        from urllib.parse import urlparse

        url = urlparse(self.state["claim"])
        store = dist.TCPStore(url.hostname, url.port, None, False, timedelta(seconds=self.timeout_s))
        rank = int(store.add(f"{self.state['session']}/rank", 1))
        if rank >= int(self.state["world_size"]):
            raise RuntimeError(f"the weight-sync group {self.ready.uri} expects {self.state['world_size'] - 1} "
                               f"receiver(s); this one would be number {rank} (raise "
                               "trainer.weights.collective_receivers)")
        return rank

    def _main(self) -> None:
        try:
            if self.rank is None:
                self.rank = self._claim_rank()
            self.group = CollectiveGroup.join(self.ready.uri, self.rank, int(self.state["world_size"]),
                                              device=self.device, timeout_s=self.timeout_s)
            while True:
                received = receive_weights(self.group)
                if received.version < 0:
                    logger.info("weight-sync group %s: the trainer left", self.ready.uri)
                    break
                tensors = dict(received)
                with self._cond:
                    self._latest = (received.version, tensors)
                    self._cond.notify_all()
                logger.info("received weights v%d (%d tensors) by broadcast", received.version, len(tensors))
        except BaseException as exc:
            self.error = exc
            logger.error("weight-sync receiver stopped: %s", exc)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
            if self.group is not None:
                self.group.close()

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest received version not taken yet, or None."""
        with self._cond:
            latest, self._latest = self._latest, None
            return latest

    def wait(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        """Block until a version >= ``version`` has been received; returns it (and takes it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._latest is None or self._latest[0] < version:
                if self._done:
                    raise RuntimeError(f"the weight-sync receiver stopped before v{version}") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"weights v{version} not received by broadcast within {timeout:.0f}s")
                self._cond.wait(left)
            latest, self._latest = self._latest, None
            return latest

    def close(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


# ---------------------------------------------------------------------------------------------------------------
# the role
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _EndWatch:
    """End offsets of ``experiences`` read right after the explorer reported (finished_step, done): once the
    trainer's positions reach them, every experience of those steps has been read."""

    key: tuple[int, bool]
    ends: Offsets


class Trainer:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *, group: str | None = None,
                 replay_from: str | ReplayStart | None = None, engine: TrainingEngine | None = None):
        self.config = config
        self.settings = config.trainer
        self.clients = clients
        self.stop = stop
        self.name = group or PRIMARY
        if not self.name.replace("-", "").replace("_", "").isalnum() or self.name in ("explorer", "rollout",
                                                                                         "monitor", "sync-view"):
            raise ConfigError(f"--group {self.name!r}: use letters, digits, '-' and '_', and not another role's name")
        self.primary = self.name == PRIMARY
        self.source = PRIMARY if self.primary else f"{PRIMARY}-{self.name}"
        self.group_id = config.group(self.name)
        self.topic = config.topic("experiences")
        self.replay = parse_replay_from(replay_from) if isinstance(replay_from, str) else replay_from
        ckpt_dir = config.checkpoint_dir
        if not self.primary:  # a fan-out trainer keeps its own lineage next to the main one
            ckpt_dir = ckpt_dir.with_name(f"{ckpt_dir.name}-{self.name}")
        self.checkpoints = Checkpoints(ckpt_dir, self.settings.keep_checkpoints)
        self.groups_per_step = config.groups_per_train_step
        self.bound = staleness_bound(config)
        self.codec = SingleObjectCodec()  # checkpointed experiences: registry-independent single-object bytes

        if engine is None:
            device = None if self.settings.device == "auto" else self.settings.device
            engine = TrainingEngine.from_pretrained(resolve_model_path(config.model.path),
                                                    training_settings(config), device=device)
        self.engine = engine
        self.consumer = clients.consumer([self.topic], Experience, self.group_id, client_id=self.source,
                                         subscribe=False)
        self.producer = clients.producer(transactional_id=f"{config.name}.{self.source}", client_id=self.source)
        self.transactor = Transactor(self.producer)  # also fences an older instance of this trainer
        self.sync = SyncView(clients, client_id=f"{self.source}-sync")
        self.metrics = MetricsPublisher(self.producer, config.topic("metrics"), self.source, "trainer")
        self.publisher = None
        if self.primary:
            method = self.settings.weights.method
            self.publisher = (CollectivePublisher(config, self.engine.device, self.source) if method == "collective"
                              else ObjectStorePublisher(config, self.source))
        self.buffer = GroupBuffer(config.explorer.repeat_times)
        self.buffer_cap = config.train_batch_size * (config.explorer.max_buffered_batches + 1)
        self.step = 0
        self.published_version = -1
        self.checkpointed_step = -1
        self.trained = 0
        self._dropped_incomplete = self._dropped_stale = 0  # since the last step's metrics
        self._end_watch: _EndWatch | None = None
        self.history: list[dict[str, float]] = []
        self._prometheus()

    def _prometheus(self) -> None:
        self.registry = CollectorRegistry()
        self.g_step = Gauge("streamrft_trainer_step", "trainer steps done (= version of the weights)",
                            registry=self.registry)
        self.g_published = Gauge("streamrft_trainer_published_version", "last published weights version",
                                 registry=self.registry)
        self.g_buffered = Gauge("streamrft_trainer_buffered_experiences", "read but not yet trained",
                                registry=self.registry)
        self.g_step_s = Gauge("streamrft_trainer_step_seconds", "duration of the last optimiser step",
                              registry=self.registry)
        self.c_trained = Counter("streamrft_trainer_experiences_trained", "experiences trained on",
                                 registry=self.registry)
        self.c_dropped = Counter("streamrft_trainer_experiences_dropped", "experiences dropped, by reason",
                                 ["reason"], registry=self.registry)
        self.endpoint = serve_prometheus(self.settings.metrics_port, self.registry)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> int:
        self._start()
        total = self.settings.total_steps
        while not self.stop.requested and (total is None or self.step < total):
            self._read()  # 1.
            self._expire(time.monotonic())  # 2.
            batch = self._next_batch()  # 3.
            if batch is not None:
                self._train(batch)  # 4.-7.
            elif self._stream_finished():
                break
        self._finish()
        return self.step

    # 1. read ----------------------------------------------------------------------------------------------
    def _read(self) -> None:
        """Take in what is already fetched — up to the explorer's backlog bound, so the oldest step's groups
        are found even when partitions deliver out of step order — and wait briefly only when no batch is
        ready."""
        ready = len(self.buffer.complete_groups()) >= self.groups_per_step
        if not (ready and len(self.buffer) >= self.buffer_cap):
            for item in self.consumer.poll(max_records=self.buffer_cap, timeout=0 if ready else POLL_S):
                if item.record.kind != RolloutKind.TRAIN:
                    continue
                if not self.buffer.add(item):
                    logger.warning("%s: duplicate experience %s at %s ignored", self.source, item.record.eid,
                                   item.where)
        self.sync.poll(0)
        self.g_buffered.set(len(self.buffer))

    # 2. incomplete groups -------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        expired = self.buffer.expired(now, self.settings.group_timeout_s)
        if expired:
            self._drop_incomplete(expired, f"still incomplete after {self.settings.group_timeout_s:.0f}s")

    def _drop_incomplete(self, groups: list[Group], why: str) -> None:
        count = sum(len(g.items) for g in groups)
        logger.warning("%s: dropping %d incomplete group(s) (%d experiences) %s: %s", self.source, len(groups),
                       count, why, ", ".join(f"{g.group_id} {len(g.items)}/{g.size}" for g in groups[:5]))
        self.buffer.remove(groups)
        self._dropped_incomplete += count
        self.c_dropped.labels("incomplete").inc(count)

    # 3. batch -------------------------------------------------------------------------------------------
    def _next_batch(self) -> list[Group] | None:
        complete = self.buffer.complete_groups()
        if len(complete) >= self.groups_per_step:
            return complete[: self.groups_per_step]
        if complete and self._short_batch_allowed():
            logger.info("%s: step %d trains a short batch of %d group(s): the explorer finished step %d",
                        self.source, self.step, len(complete), self.sync.explorer.finished_step)
            return complete
        return None

    def _short_batch_allowed(self) -> bool:
        """The explorer has finished every step in the buffer, all it wrote is read, and no group of those
        steps is still incomplete: no more groups can come for them."""
        explorer = self.sync.explorer
        if explorer.finished_step < self.buffer.max_batch_id() or self.buffer.incomplete_groups():
            return False
        return self._read_everything_written()

    def _read_everything_written(self) -> bool:
        """True once our positions reach the end offsets read after the explorer's latest progress report."""
        explorer = self.sync.explorer
        key = (explorer.finished_step, explorer.done)
        if self._end_watch is None or self._end_watch.key != key:
            self._end_watch = _EndWatch(key, self.clients.offsets(self.topic, "end"))
        positions = self.consumer.fetch_positions()
        return all(positions.get(tp, 0) >= end for tp, end in self._end_watch.ends.items())

    def _stream_finished(self) -> bool:
        """The explorer is done and everything it produced is read (and trained, or dropped as incomplete)."""
        if not self.sync.explorer.done or not self._read_everything_written():
            return False
        leftovers = self.buffer.incomplete_groups()
        if leftovers:
            self._drop_incomplete(leftovers, "and the explorer is done")
        return not self.buffer.complete_groups()

    # 4.-7. train, publish, commit, checkpoint -------------------------------------------------------------
    def _train(self, groups: list[Group]) -> None:
        index, experiences = self.step, [exp for g in groups for exp in g.experiences]
        lags = [self.step - e.model_version for e in experiences]
        decision = apply_staleness(experiences, self.step, self.bound, self.settings.staleness_policy)
        self.buffer.remove(groups)
        self._dropped_stale += decision.dropped
        if decision.dropped:
            self.c_dropped.labels("stale").inc(decision.dropped)
        if not decision.kept:  # nothing to learn from: release the offsets; the counts go with the next step
            logger.warning("%s: all %d experiences of the batch are stale (weights v%d, bound %d); no step",
                           self.source, len(experiences), self.step, self.bound)
            self.consumer.commit_offsets(self._trained_through())
            return
        started = time.monotonic()
        metrics = self.engine.train_step(decision.kept, correct=decision.correct)  # 4.
        train_s = time.monotonic() - started
        self.step += 1
        self.trained += len(decision.kept)
        self.c_trained.inc(len(decision.kept))
        kept = {id(e) for e in decision.kept}
        self.checkpoints.record(index, self.step, [e.eid for e in decision.kept],
                                [e.eid for e in experiences if id(e) not in kept])
        metrics.update({
            "trainer/dropped_stale": float(self._dropped_stale),
            "trainer/dropped_incomplete": float(self._dropped_incomplete),
            "trainer/staleness": sum(lags) / len(lags),
            "trainer/staleness_max": float(max(lags)),
            "trainer/groups": float(len(groups)),
            "trainer/short_batch": float(len(groups) < self.groups_per_step),
            "trainer/buffered": float(len(self.buffer)),
            "time/train_step": train_s,
        })
        self._dropped_stale = self._dropped_incomplete = 0
        signal = None
        if self.publisher is not None and self.step % self.config.explorer.sync_interval == 0:
            signal, metrics["time/publish_weights"] = self._publish_weights()  # 5.
        self._commit(index, metrics, signal)  # 6.
        self.history.append({"step": float(index), **metrics})
        self.g_step.set(self.step)
        self.g_step_s.set(train_s)
        logger.info("%s: step %d -> v%d: %d experiences (%d groups, %d stale dropped), reward %.3f, loss %.4f, "
                    "%.2fs", self.source, index, self.step, len(decision.kept), len(groups), decision.dropped,
                    metrics["actor/reward_mean"], metrics["actor/loss"], train_s)
        if self.step % self.settings.save_interval == 0:
            self._checkpoint()  # 7.

    def _publish_weights(self) -> tuple[SyncSignal, float]:
        started = time.monotonic()
        signal = self.publisher.publish(self.engine, self.step)
        self.published_version = self.step
        self.g_published.set(self.step)
        return signal, time.monotonic() - started

    def _commit(self, index: int, metrics: dict[str, float], signal: SyncSignal | None) -> None:
        """The step's metrics and signal in one transaction, then the trained-through offsets."""
        def produce(producer: RecordProducer) -> None:
            if signal is not None:
                producer.produce(self.config.topic("sync"), signal)
            self.metrics.publish(index, metrics)

        self._transaction(produce, f"step {index}")
        self.consumer.commit_offsets(self._trained_through())

    def _transaction(self, produce, what: str) -> None:
        for attempt in range(3):
            if self.transactor.run(produce):
                return
            logger.warning("%s: transaction for %s aborted; retrying (%d)", self.source, what, attempt + 1)
        raise RuntimeError(f"{self.source}: could not commit the transaction for {what}")

    def _trained_through(self) -> Offsets:
        """Per partition: the oldest buffered offset, else everything read."""
        offsets = self.consumer.positions()
        offsets.update(self.buffer.low_water())
        return offsets

    # -- checkpoints --------------------------------------------------------------------------------------
    def _checkpoint(self, with_model: bool = True) -> None:
        if self.step == self.checkpointed_step:
            return  # that step's checkpoint is a consistent snapshot already; later reads are simply re-read
        started = time.monotonic()
        buffered = [{"topic": i.topic, "partition": i.partition, "offset": i.offset, "timestamp_ms": i.timestamp_ms,
                     "value": self.codec.encode(i.record)} for i in self.buffer.items()]
        meta = {"group": self.group_id, "published_version": self.published_version,
                "model_path": self.config.model.path}
        path = self.checkpoints.save(self.step, self.engine.state_dict() if with_model else None,
                                     self.consumer.positions(), buffered, meta)
        self.checkpointed_step = self.step
        logger.info("%s: checkpoint %s (%d buffered) in %.1fs", self.source, path, len(buffered),
                    time.monotonic() - started)

    def _start(self) -> None:
        """Catch up on ``sync``; resume from the newest checkpoint, or start a lineage at the replay point / the
        group's committed offsets / the beginning, recorded in a step-0 checkpoint."""
        self.sync.catch_up()
        partitions = self.clients.offsets(self.topic, "start")
        latest = self.checkpoints.latest()
        if latest is not None and self.replay is not None:
            raise ConfigError(
                f"--replay-from {self.replay}: {self.checkpoints.root} already holds checkpoints (newest "
                f"{latest.name}); a replay starts a new lineage: give it its own --group, remove that directory, "
                "or drop --replay-from to resume")
        if latest is not None:
            offsets = self._resume(latest, partitions)
        else:
            offsets = self._origin(partitions)
        self.consumer.assign(offsets)
        if self.publisher is not None:
            announcement = self.publisher.announcement()
            if announcement is not None:
                self._transaction(lambda p: p.produce(self.config.topic("sync"), announcement), "NCCL_READY")
                logger.info("%s: weight-sync group at %s, waiting for %d receiver(s)", self.source,
                            announcement.uri, self.publisher.world_size - 1)
            if self.sync.version > self.step:
                logger.warning("%s: weights v%d on %s are newer than the resumed v%d: that training was lost "
                               "with the process; versions up to v%d are published again from this lineage",
                               self.source, self.sync.version, self.sync.topic, self.step, self.sync.version)
        logger.info("%s: ready after %d steps (group %s, %d buffered, staleness bound %d, checkpoints in %s)",
                    self.source, self.step, self.group_id, len(self.buffer), self.bound, self.checkpoints.root)

    def _resume(self, path: Path, partitions: Offsets) -> Offsets:
        checkpoint, engine_state = self.checkpoints.load(path, map_location=self.engine.device)
        if engine_state is not None:
            self.engine.load_state_dict(engine_state)
        self.step = self.checkpointed_step = checkpoint.step
        self.published_version = int(checkpoint.meta.get("published_version", -1))
        now = time.monotonic()
        for entry in checkpoint.buffered:
            record = self.codec.decode(entry["value"], Experience)
            self.buffer.add(Delivered(record, entry["topic"], int(entry["partition"]), int(entry["offset"]),
                                      record.group_id, int(entry.get("timestamp_ms", 0))), now)
        removed = self.checkpoints.truncate_audit(checkpoint.step)
        offsets = {tp: checkpoint.offsets.get(tp, low) for tp, low in partitions.items()}
        self.g_step.set(self.step)
        logger.info("%s: resuming from %s: %d steps done (weights v%d), %d buffered experience(s), %d audit "
                    "entr%s of lost steps removed", self.source, path, self.step, self.step, len(checkpoint.buffered),
                    removed, "y" if removed == 1 else "ies")
        return offsets

    def _origin(self, partitions: Offsets) -> Offsets:
        ends = self.clients.offsets(self.topic, "end")
        if self.replay is not None and self.replay.offset is not None:
            offsets = {tp: min(max(self.replay.offset, low), ends[tp]) for tp, low in partitions.items()}
            origin = f"replay from {self.replay}"
        elif self.replay is not None:
            offsets = self.clients.offsets_for_time(self.topic, self.replay.timestamp_ms)
            origin = f"replay from {self.replay}"
        else:
            committed = self.clients.committed(self.group_id, self.topic)
            offsets = {tp: max(committed.get(tp, low), low) for tp, low in partitions.items()}
            origin = "the group's committed offsets" if committed else "the beginning"
        self.checkpoints.truncate_audit(0)
        self._checkpoint_origin(offsets)
        logger.info("%s: new lineage from %s: %s", self.source, origin,
                    ", ".join(f"[{p}]@{o}" for (_, p), o in sorted(offsets.items())))
        return offsets

    def _checkpoint_origin(self, offsets: Offsets) -> None:
        """Step 0: the starting offsets and the base model (no weights written)."""
        meta = {"group": self.group_id, "published_version": -1, "model_path": self.config.model.path,
                "origin": True}
        self.checkpoints.save(0, None, offsets, [], meta)
        self.checkpointed_step = 0

    # -- the end ------------------------------------------------------------------------------------------
    def _finish(self) -> None:
        if self.stop.requested:
            logger.info("%s: stop requested after %d steps; checkpointing", self.source, self.step)
        elif self.publisher is not None and self.step > max(self.published_version, 0):
            signal, seconds = self._publish_weights()
            self._transaction(lambda p: p.produce(self.config.topic("sync"), signal), f"publishing v{self.step}")
            logger.info("%s: final weights v%d published in %.1fs", self.source, self.step, seconds)
        self._checkpoint()
        logger.info("%s: stopped after %d steps (%d experiences trained, %d buffered)", self.source, self.step,
                    self.trained, len(self.buffer))

    def close(self) -> None:
        closers = [self.consumer.close, self.sync.close, self.endpoint.close]
        if self.publisher is not None:
            closers.insert(0, self.publisher.close)
        for closer in closers:
            try:
                closer()
            except Exception:
                logger.debug("close failed", exc_info=True)
