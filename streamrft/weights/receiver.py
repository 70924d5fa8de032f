"""A rollout worker's (or a server's) membership of the trainer's weight-sync group (``collective``): which
announced group it may join (:func:`check_announcement`), where it receives (:func:`receiver_device`), and the
receiver that takes every broadcast on a background thread (:class:`CollectiveReceiver`)."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from urllib.parse import urlparse

import torch
from torch.distributed import DistNetworkError

from streamrft.engines.weights.collective import receive_weights
from streamrft.engines.weights.elastic import ElasticMember
from streamrft.engines.weights.signal_state import Announcement
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal

logger = logging.getLogger(__name__)


def check_announcement(ready: SyncSignal, host: str, port: int = 0) -> Announcement:
    """The state of an NCCL_READY that a worker of this run may join, or ValueError saying why not: the
    membership store must be on the configured ``trainer.weights.collective_host`` (and on
    ``collective_port + 1`` when a port is set), the state must be what the trainer writes (``Announcement``).
    Without this a forged announcement sends every worker's registration to an address of the forger's
    choice. (Each epoch's group address is checked the same way when it is read: ``ElasticMember``.)"""
    if ready.kind != SyncKind.NCCL_READY or ready.method != SyncMethod.COLLECTIVE:
        raise ValueError(f"expected an NCCL_READY signal of method COLLECTIVE, got {ready.kind.value} / "
                         f"{ready.method.value}")
    state = Announcement.parse(ready.state)
    url = urlparse(ready.uri)
    if url.scheme != "tcp" or (url.hostname or "").lower() != host.lower() or not url.port:
        raise ValueError(f"its membership store {ready.uri!r} is not tcp://{host}:<port> "
                         "(trainer.weights.collective_host)")
    if port and url.port != port + 1:
        raise ValueError(f"its membership store port {url.port} is not trainer.weights.collective_port + 1 "
                         f"({port + 1})")
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
    group (unique per receiver: a restarted worker is a new member); ``secret``: the run's
    ``trainer.weights.group_secret``, which the trainer admits members by."""

    def __init__(self, ready: SyncSignal, *, member: str, host: str, group_port: int = 0,
                 device: torch.device | str = "cpu", timeout_s: float = 30.0, secret: bytes | None = None):
        if ready.kind != SyncKind.NCCL_READY:
            raise ValueError(f"expected an NCCL_READY signal, got {ready.kind}")
        self.ready = ready
        self.announced = Announcement.parse(ready.state)
        self.member = f"{member}/{uuid.uuid4().hex[:8]}"
        self.host = host
        self.group_port = group_port
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._secret = secret
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
                self.ready.uri, self.announced.session, self.member, host=self.host, group_port=self.group_port,
                device=self.device, timeout_s=self.timeout_s, secret=self._secret)
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
