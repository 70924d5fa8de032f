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

import torch
from torch.distributed import DistNetworkError

from streamrft.config import RunConfig
from streamrft.engines.training import TrainingEngine
from streamrft.engines.weights import ObjectStore, backend_for, new_lineage, receive_weights
from streamrft.engines.weights.elastic import Delivery, ElasticMember, ElasticSender, delivery_state
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
        published = self.store.publish(engine.named_weights(), version=version, metadata=engine.publish_metadata())
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, trainer_step=version,
                          method=SyncMethod.OBJECT_STORE, uri=published.uri, sha256=published.sha256,
                          nbytes=published.nbytes, source=self.source, lineage=self.lineage)

    def close(self) -> None:
        pass


class CollectivePublisher:
    """The trainer's side of ``collective``: rank 0 of an elastic group (``engines.weights.elastic``) whose
    members come and go; every version is also published to the object store (``trainer.weights.catch_up``),
    so a worker that missed a broadcast or joined late catches up from there."""

    def __init__(self, config: RunConfig, device: torch.device, source: str):
        w = config.trainer.weights
        self.expected_receivers = w.collective_receivers
        self.first_wait_s = w.collective_timeout_s
        self.bucket_bytes = w.bucket_mb << 20
        self.device = device
        self.source = source
        self.lineage = new_lineage()
        self.session = uuid.uuid4().hex[:12]
        # both stores listen on collective_host only (loopback by default), never on every interface
        self.sender = ElasticSender(w.collective_host, self.session, device=device,
                                    port=w.collective_port + 1 if w.collective_port else 0,
                                    group_port=w.collective_port, timeout_s=w.receiver_timeout_s)
        self.catch_up = (ObjectStore(config.weights_url, lineage=self.lineage, keep_last=w.keep_last,
                                     max_shard_bytes=w.shard_mb << 20) if w.catch_up == "object_store" else None)
        self.last_delivery: Delivery | None = None
        self._first = True

    def announcement(self) -> SyncSignal:
        """NCCL_READY: where the membership store is. Receivers register there from now on."""
        # the backend is the trainer's to choose (its device); receivers follow it, whatever their own device
        state = {"session": self.session, "receivers": self.expected_receivers, "bucket_bytes": self.bucket_bytes,
                 "backend": backend_for(self.device)}
        return SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE,
                          uri=self.sender.address, source=self.source, state=json.dumps(state), lineage=self.lineage)

    def publish(self, engine: TrainingEngine, version: int) -> SyncSignal:
        """Broadcast to the members there are (never raises for a receiver's failure), then the catch-up copy,
        then the signal: who got it by broadcast, and where the others find it."""
        if self._first:
            self._first = False
            joined = self.sender.wait_for(self.expected_receivers, self.first_wait_s)
            if joined < self.expected_receivers:
                logger.warning("%s: %d of %d weight-sync receiver(s) registered within %.0fs "
                               "(trainer.weights.collective_timeout_s); broadcasting to those, the others catch "
                               "up when they come", self.source, joined, self.expected_receivers, self.first_wait_s)
        delivery = self.sender.broadcast(engine.named_weights(), version, bucket_bytes=self.bucket_bytes)
        self.last_delivery = delivery
        catch_up = (self.catch_up.publish(engine.named_weights(), version=version, metadata=engine.publish_metadata())
                    if self.catch_up else None)
        nbytes = delivery.stats.nbytes if delivery.stats else (catch_up.nbytes if catch_up else 0)
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, trainer_step=version,
                          method=SyncMethod.COLLECTIVE, uri=self.sender.address, nbytes=nbytes,
                          sha256=catch_up.sha256 if catch_up else "", source=self.source, lineage=self.lineage,
                          state=delivery_state(delivery, catch_up.uri if catch_up else ""))

    def close(self) -> None:
        self.sender.close()


_SESSION_CHARS = set("0123456789abcdef")


def check_announcement(ready: SyncSignal, host: str, port: int = 0) -> dict:
    """The state of an NCCL_READY that a worker of this run may join, or ValueError saying why not: the
    membership store must be on the configured ``trainer.weights.collective_host`` (and on
    ``collective_port + 1`` when a port is set), the state must be what :class:`CollectivePublisher` writes.
    Without this a forged announcement sends every worker's registration to an address of the forger's
    choice. (Each epoch's group address is checked the same way when it is read: ``ElasticMember``.)"""
    from urllib.parse import urlparse

    if ready.kind != SyncKind.NCCL_READY or ready.method != SyncMethod.COLLECTIVE:
        raise ValueError(f"expected an NCCL_READY signal of method COLLECTIVE, got {ready.kind.value} / "
                         f"{ready.method.value}")
    state = json.loads(ready.state)
    if not isinstance(state, dict):
        raise ValueError("its state is not a JSON object")
    url = urlparse(ready.uri)
    if url.scheme != "tcp" or (url.hostname or "").lower() != host.lower() or not url.port:
        raise ValueError(f"its membership store {ready.uri!r} is not tcp://{host}:<port> "
                         "(trainer.weights.collective_host)")
    if port and url.port != port + 1:
        raise ValueError(f"its membership store port {url.port} is not trainer.weights.collective_port + 1 "
                         f"({port + 1})")
    receivers, session = state.get("receivers"), state.get("session")
    if isinstance(receivers, bool) or not isinstance(receivers, int) or not 0 <= receivers <= 1 << 16:
        raise ValueError(f"receivers {receivers!r} is not an integer in 0..65536")
    if not isinstance(session, str) or not 1 <= len(session) <= 64 or not set(session) <= _SESSION_CHARS:
        raise ValueError(f"session {session!r} is not a hex token")
    if state.get("backend") not in ("gloo", "nccl"):
        raise ValueError(f"backend {state.get('backend')!r} is not gloo or nccl")
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
    """Inference side of ``collective``: registers with the trainer's membership store and receives every
    broadcast of each epoch it is in, on a background thread; the owner takes a version with :meth:`wait`.
    ``device`` must suit the announced backend (:func:`receiver_device`); ``member`` names this receiver in the
    group (unique per receiver: a restarted worker is a new member)."""

    def __init__(self, ready: SyncSignal, *, member: str, host: str, group_port: int = 0,
                 device: torch.device | str = "cpu", timeout_s: float = 30.0):
        if ready.kind != SyncKind.NCCL_READY:
            raise ValueError(f"expected an NCCL_READY signal, got {ready.kind}")
        self.ready = ready
        self.state = json.loads(ready.state)
        self.member = f"{member}/{uuid.uuid4().hex[:8]}"
        self.host = host
        self.group_port = group_port
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.epoch = 0  # the epoch whose group this receiver is in now (0: none)
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._done = False
        self._membership: ElasticMember | None = None
        self.registered = threading.Event()  # set once this member is in the membership log
        self._thread = threading.Thread(target=self._main, name="weight-sync-receive", daemon=True)

    def start(self) -> "CollectiveReceiver":
        self._thread.start()
        return self

    def _main(self) -> None:
        try:
            membership = self._membership = ElasticMember(
                self.ready.uri, self.state["session"], self.member, host=self.host, group_port=self.group_port,
                device=self.device, timeout_s=self.timeout_s)
            membership.register()
            self.registered.set()
            epoch = 0
            while not self._closing:
                joined = membership.next_group(epoch, lambda: self._closing)
                if joined is None:
                    logger.info("weight-sync %s: the trainer left", self.ready.uri)
                    break
                epoch, group = joined
                self._receive_epoch(epoch, group)
        except DistNetworkError as exc:
            if not self.registered.is_set():
                self.error = exc
                logger.error("weight-sync receiver could not reach the trainer's membership store %s: %s",
                             self.ready.uri, exc)
            else:  # it went away between two polls: the trainer stopped (or died; a new one announces itself)
                logger.info("weight-sync %s: the trainer's membership store is gone", self.ready.uri)
        except BaseException as exc:
            self.error = exc
            logger.error("weight-sync receiver stopped: %s", exc)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _receive_epoch(self, epoch: int, group) -> None:
        """Every broadcast of one epoch, until it ends (this member is kept for the next) or fails (it registers
        again)."""
        with self._cond:
            self.epoch = epoch
        try:
            seen = 0
            while self._membership.next_sync(epoch, seen, lambda: self._closing):
                seen += 1
                received = receive_weights(group)
                tensors = dict(received)
                with self._cond:
                    self._latest = (received.version, tensors)
                    self._cond.notify_all()
                logger.info("received weights v%d (%d tensors) by broadcast in epoch %d", received.version,
                            len(tensors), epoch)
        except Exception as exc:  # noqa: BLE001 - the trainer or another receiver failed: this epoch is over
            logger.warning("weight-sync epoch %d ended with an error (%s); registering again", epoch, exc)
            self._membership.register()
        finally:
            group.close()
            with self._cond:
                self.epoch = 0
                self._cond.notify_all()

    def wait(self, version: int, timeout: float, *, epoch: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The received version >= ``version`` (taken), waiting up to ``timeout`` while this receiver is still in
        the group of ``epoch`` (which carried it); None at once when it is not (it missed that broadcast)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._latest is None or self._latest[0] < version:
                if self._done:
                    raise RuntimeError(f"the weight-sync receiver stopped before v{version}") from self.error
                left = deadline - time.monotonic()
                if self.epoch != epoch or left <= 0:
                    return None
                self._cond.wait(left)
            latest, self._latest = self._latest, None
            return latest

    def close(self, timeout: float = 5.0) -> None:
        """Leave the group (the trainer re-forms it without this member at its next sync) and wait up to
        ``timeout`` for the receiving thread to end."""
        self._closing = True
        if self._membership is not None and not self._done:
            try:
                self._membership.register("leave")
            except Exception:  # noqa: BLE001 - the trainer may be gone already
                logger.debug("could not register leaving", exc_info=True)
        self._thread.join(timeout)
