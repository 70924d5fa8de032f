"""Moving weights from the trainer to the inference side: publishing to object storage, and the collective
(torch.distributed broadcast) group that the trainer leads and rollout workers join through `sync` signals.

Each publisher is one trainer lifetime and has its own *lineage* id (:func:`new_lineage`), put in every signal
it sends: a trainer that resumes from an older checkpoint publishes versions it had published before, and
workers follow it because the lineage changed (``weight_follower.supersedes``)."""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import timedelta

import torch

from streamrft.config import RunConfig
from streamrft.engines.training import TrainingEngine
from streamrft.engines.weights import (
    CollectiveGroup,
    ObjectStore,
    backend_for,
    broadcast_weights,
    free_port,
    new_lineage,
    receive_weights,
)
from streamrft.engines.weights.collective import listening_store
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal

logger = logging.getLogger(__name__)


class ObjectStorePublisher:
    """Uploads a version, then returns the signal that announces it (never before the upload is complete)."""

    def __init__(self, config: RunConfig, source: str):
        w = config.trainer.weights
        self.lineage = new_lineage()
        self.store = ObjectStore(config.weights_url, lineage=self.lineage, keep_last=w.keep_last,
                                 max_shard_bytes=w.shard_mb << 20)
        self.source = source

    def announcement(self) -> SyncSignal | None:
        return None

    def publish(self, engine: TrainingEngine, version: int) -> SyncSignal:
        published = self.store.publish(engine.named_weights(), version=version)
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, trainer_step=version,
                          method=SyncMethod.OBJECT_STORE, uri=published.uri, sha256=published.sha256,
                          nbytes=published.nbytes, source=self.source, lineage=self.lineage)

    def close(self) -> None:
        pass


class CollectivePublisher:
    """Rank 0 of the weight-sync group (see the module docstring for the rendezvous)."""

    def __init__(self, config: RunConfig, device: torch.device, source: str):
        w = config.trainer.weights
        self.host = w.collective_host
        self.world_size = 1 + w.collective_receivers
        self.timeout_s = w.collective_timeout_s
        self.bucket_bytes = w.bucket_mb << 20
        self.device = device
        self.source = source
        self.lineage = new_lineage()
        self.session = uuid.uuid4().hex[:12]
        group_port = w.collective_port or free_port(self.host)
        # both stores listen on collective_host only (loopback by default), never on every interface
        self._claims, claim_port = listening_store(self.host, w.collective_port + 1 if w.collective_port else 0,
                                                   timeout_s=self.timeout_s)
        self.address = f"tcp://{self.host}:{group_port}"
        self.claim_address = f"tcp://{self.host}:{claim_port}"
        self.group: CollectiveGroup | None = None
        self._error: BaseException | None = None
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._join, name="weight-sync-join", daemon=True)

    def announcement(self) -> SyncSignal:
        """NCCL_READY: where to join, how many, and where to claim a rank. Joining starts now."""
        if not self._thread.is_alive() and not self._joined.is_set():
            self._thread.start()
        # the backend is the trainer's to choose (its device); receivers follow it, whatever their own device
        state = {"world_size": self.world_size, "claim": self.claim_address, "session": self.session,
                 "bucket_bytes": self.bucket_bytes, "backend": backend_for(self.device)}
        return SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE, uri=self.address,
                          source=self.source, state=json.dumps(state), lineage=self.lineage)

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
                          method=SyncMethod.COLLECTIVE, uri=self.address, nbytes=stats.nbytes, source=self.source,
                          lineage=self.lineage)

    def close(self) -> None:
        if self.group is not None:
            try:
                broadcast_weights(self.group, [], -1)  # tells receivers to leave
            except Exception:
                logger.debug("farewell broadcast failed", exc_info=True)
            self.group.close()
            self.group = None
        self._claims = None


_SESSION_CHARS = set("0123456789abcdef")


def check_announcement(ready: SyncSignal, host: str, port: int = 0) -> dict:
    """The state of an NCCL_READY that a worker of this run may join, or ValueError saying why not: the group
    and the rank-claim store must both be on the configured ``trainer.weights.collective_host`` (and the
    configured group port, when one is set), the state must be what :class:`CollectivePublisher` writes.
    Without this a forged announcement sends every worker's rank claim to an address of the forger's choice."""
    from urllib.parse import urlparse

    if ready.kind != SyncKind.NCCL_READY or ready.method != SyncMethod.COLLECTIVE:
        raise ValueError(f"expected an NCCL_READY signal of method COLLECTIVE, got {ready.kind.value} / "
                         f"{ready.method.value}")
    state = json.loads(ready.state)
    if not isinstance(state, dict):
        raise ValueError("its state is not a JSON object")
    for what, address, wanted_port in (("group", ready.uri, port), ("claim", state.get("claim"), 0)):
        url = urlparse(address) if isinstance(address, str) else None
        if url is None or url.scheme != "tcp" or (url.hostname or "").lower() != host.lower() or not url.port:
            raise ValueError(f"its {what} address {address!r} is not tcp://{host}:<port> "
                             "(trainer.weights.collective_host)")
        if wanted_port and url.port != wanted_port:
            raise ValueError(f"its {what} port {url.port} is not trainer.weights.collective_port {wanted_port}")
    world_size, session = state.get("world_size"), state.get("session")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 2 <= world_size <= 1 << 16:
        raise ValueError(f"world_size {world_size!r} is not an integer in 2..65536")
    if not isinstance(session, str) or not 1 <= len(session) <= 64 or not set(session) <= _SESSION_CHARS:
        raise ValueError(f"session {session!r} is not a hex token")
    backend = state.setdefault("backend", "gloo")  # announcements before the field existed came from CPU trainers
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not gloo or nccl")
    bucket_bytes = state.get("bucket_bytes", 1)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes {bucket_bytes!r} is not a positive integer")
    return state


def receiver_device(backend: str, device: str) -> torch.device:
    """Where a receiver of a ``backend`` group receives: the CPU for gloo; for NCCL the worker's CUDA device
    (``device`` when it names one, else the current one). ValueError when NCCL is announced and this process
    has no CUDA device: such a worker can never meet a CUDA trainer's group."""
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("the trainer broadcasts over NCCL (it trains on CUDA) and this worker has no CUDA "
                         "device; run the workers on GPUs, or use trainer.weights.method: object_store")
    return torch.device(device) if device.startswith("cuda") else torch.device("cuda", torch.cuda.current_device())


class CollectiveReceiver:
    """Inference side of ``collective``: claims a rank, joins the trainer's group and receives every broadcast
    on a background thread; the owner waits for a version with :meth:`wait`. Every receiver must keep receiving
    (the trainer's broadcast waits for all). ``device`` must suit the announced backend
    (:func:`receiver_device`)."""

    def __init__(self, ready: SyncSignal, *, device: torch.device | str = "cpu", timeout_s: float = 300.0):
        if ready.kind != SyncKind.NCCL_READY:
            raise ValueError(f"expected an NCCL_READY signal, got {ready.kind}")
        self.ready = ready
        self.state = json.loads(ready.state)
        self.device = torch.device(device)
        self.rank: int | None = None
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
        """Wait up to ``timeout`` for the receiving thread to end (it ends at the trainer's farewell)."""
        self._thread.join(timeout)
