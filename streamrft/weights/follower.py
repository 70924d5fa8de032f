"""What a rollout worker (or a server) does with weights: decide which published version to serve, fetch it only
from where this run publishes, verify it, load it, and report what it refused. The worker calls, in its loop:

* :meth:`WeightFollower.follow` after each poll of ``sync`` (joins / replaces the collective receiver when the
  run uses ``trainer.weights.method: collective``; checks a newly announced version at once, so a forged one is
  reported without waiting for the worker to need it);
* :meth:`WeightFollower.swap_to_latest` when its sync style swaps as soon as a version appears;
* :meth:`WeightFollower.refused` when a request needs a version it does not serve (waiting for one that was
  refused is pointless);
* :meth:`WeightFollower.take_refusals` to dead-letter (and count) what was refused.

Trust. A WEIGHTS_PUBLISHED is loaded only when its method is the configured transport; for ``object_store``
its URI must be exactly the manifest of (its version, its lineage) under ``trainer.weights.url`` (same
protocol, no ``..``), its sha256 must be present and match the manifest's bytes, the manifest must say the
same version and lineage, every shard must be a plain file of that directory, and the engine must accept the
tensors' names and shapes (checked from the manifest, before anything is fetched). Every failure is a refusal,
never an exception out of here; the engine keeps the weights it had.

Lineage. A trainer that resumes from a checkpoint publishes again versions it had published before the crash,
under a new lineage id. ``supersedes`` (declared in ``streamrft.sync``, which ``SyncView`` applies too) is the
one rule of which signal is newer: another lineage always, within one lineage a higher version. It relies on
the ``sync`` topic having one partition (``topics.sync.partitions`` is validated to be 1) so signals arrive in
the order they were written.

Collective catch-up. A collective WEIGHTS_PUBLISHED says which epoch of the elastic group carried the version
to which members, and where its object-store copy is (``trainer.weights.catch_up``): a worker that was not among
them, or whose group broke, loads that copy — checked like an object-store signal — instead of waiting. A
broadcast copy is loaded only if it hashes to the digest the signal carries (``broadcast_digest``); one that does
not is refused and the catch-up copy is loaded instead.

Retries. Errors of the store itself (``OSError``: not reachable, not there yet, a timeout) are retried with a
backoff of 1 s doubling to 30 s, at most ``retry_attempts`` times per signal; any other refusal is final for
that signal (same lineage, version, method, URI and sha256 — a forged signal cannot pre-empt the real one of
the same version). The reasons and that bookkeeping are ``refusals``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine
from streamrft.engines.lora import AdapterMerger, read_base_weights
from streamrft.engines.settings.lora import ADAPTER_PAYLOAD, PAYLOAD_KEY, LoraSettings
from streamrft.engines.weights.broadcast_digest import check_weights_digest
from streamrft.engines.weights.errors import BroadcastIntegrityError
from streamrft.engines.weights.locations import check_lineage, check_manifest_uri, is_sha256
from streamrft.engines.weights.object_store import load_weights, read_manifest
from streamrft.engines.weights.signal_state import DeliveryState
from streamrft.lifecycle import StopSignal
from streamrft.metric_catalog import prometheus_metric
from streamrft.model_paths import resolve_model_path
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal
from streamrft.sync import SyncView, supersedes

from .receiver import CollectiveReceiver, check_announcement, receiver_device
from .refusals import HINTS, Refusal, Refusals, Refused, identity

logger = logging.getLogger(__name__)

_METHODS = {"object_store": SyncMethod.OBJECT_STORE, "collective": SyncMethod.COLLECTIVE}


class WeightFollower:
    """Owns everything a rollout worker does with weights (see the module docstring)."""

    def __init__(self, config: RunConfig, engine: InferenceEngine, worker_id: str, registry: CollectorRegistry,
                 *, retry_initial_s: float = 1.0, retry_max_s: float = 30.0, retry_attempts: int = 10,
                 collective_wait_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 receiver_factory: Callable[..., CollectiveReceiver] = CollectiveReceiver):
        weights = config.trainer.weights
        self.engine = engine
        self.worker_id = worker_id
        self.lora = config.model.lora
        # under LoRA the trainer publishes adapters; they are merged into the base weights read here
        self.merger = (AdapterMerger(self.lora, read_base_weights(resolve_model_path(config.model.path), self.lora))
                       if self.lora is not None else None)
        self.method = _METHODS[weights.method]
        self.store_url = config.weights_url
        self.storage_options = weights.storage_options()  # the trainer's store, reached as the trainer reaches it
        self.collective_host = weights.collective_host
        self.collective_port = weights.collective_port
        self.receiver_timeout_s = weights.receiver_timeout_s
        self.group_secret = weights.group_secret.get_secret_value().encode() if weights.group_secret else None
        self.device = config.rollout.device  # only where NCCL receives (see receiver_device)
        self.collective_wait_s = collective_wait_s
        self._clock = clock
        self._receiver_factory = receiver_factory
        self._receiver: CollectiveReceiver | None = None
        self._announcement: tuple | None = None  # identity of the last NCCL_READY acted on
        self._noted: tuple | None = None  # identity of the last WEIGHTS_PUBLISHED prechecked by follow()
        self._loaded: SyncSignal | None = None  # what the engine serves; None = the weights it was built with
        self.refusals = Refusals(worker_id, registry, retry_initial_s=retry_initial_s, retry_max_s=retry_max_s,
                                 retry_attempts=retry_attempts, clock=clock)
        self.c_caught_up = prometheus_metric("streamrft_rollout_weights_caught_up", registry)
        self.g_version = prometheus_metric("streamrft_rollout_model_version", registry)
        self.g_version.set(engine.version)

    # -- the worker's calls -------------------------------------------------------------------------------
    def follow(self, view: SyncView) -> None:
        """After each poll of ``sync``: act on a new NCCL_READY, and precheck a new WEIGHTS_PUBLISHED (no
        fetch) so that a forged one is refused and reported now."""
        ready = view.collective_ready
        if ready is not None and identity(ready) != self._announcement:
            self._announcement = identity(ready)
            self._follow_announcement(ready)
        latest = view.weights
        if latest is not None and identity(latest) != self._noted:
            self._noted = identity(latest)
            if supersedes(self._loaded, latest) and not self.refusals.final(latest):
                try:
                    self._precheck(latest)
                except Exception as exc:  # noqa: BLE001 - a refusal, whatever the signal holds
                    self._refuse(latest, exc)

    def swap_to_latest(self, view: SyncView) -> bool:
        """Load the view's newest weights unless the engine serves them already (or they were refused, or a
        retry is not due yet). True if the engine now serves new weights."""
        signal = view.weights
        if signal is None or not self._due(signal):
            return False
        return self._load(signal)

    def newer_due(self, view: SyncView) -> bool:
        """Whether :meth:`swap_to_latest` would load something now (a worker drains its engine first)."""
        return view.weights is not None and self._due(view.weights)

    def serves(self, minimum: int, view: SyncView) -> bool:
        """Whether the engine serves at least ``minimum`` of the trainer's current lineage."""
        return self._serves(minimum, view)

    def refused(self, minimum: int, view: SyncView) -> bool:
        """Whether the newest version announced, which would serve ``minimum``, was refused for good: a request
        that needs it waits in vain."""
        latest = view.weights
        return latest is not None and latest.version >= minimum and self.refusals.final(latest)

    def take_refusals(self) -> list[Refusal]:
        return self.refusals.take()

    @property
    def loaded(self) -> SyncSignal | None:
        """The signal whose weights the engine serves (None: the weights it was built with)."""
        return self._loaded

    def close(self) -> None:
        # a receiver's daemon thread ends with the trainer's farewell broadcast or the process; do not block
        if self._receiver is not None:
            self._receiver.close(timeout=0.1)
            self._receiver = None

    # -- deciding -----------------------------------------------------------------------------------------
    def _serves(self, minimum: int, view: SyncView) -> bool:
        if minimum <= 0:
            return True  # the weights the engine was built with will do
        if self.engine.version < minimum:
            return False
        latest = view.weights
        # a higher version of a lineage the trainer has left is not "at least minimum" of the current one
        return latest is None or (self._loaded is not None and self._loaded.lineage == latest.lineage)

    def _due(self, signal: SyncSignal) -> bool:
        return (signal.kind == SyncKind.WEIGHTS_PUBLISHED and supersedes(self._loaded, signal)
                and self.refusals.due(signal))

    def _precheck(self, signal: SyncSignal) -> None:
        """Everything that can be refused from the signal alone, before any I/O."""
        if signal.kind != SyncKind.WEIGHTS_PUBLISHED:
            raise Refused("bad-signal", f"kind {signal.kind.value} does not announce weights")
        if signal.method != self.method:
            raise Refused("wrong-method", f"method {signal.method.value}; this run's trainer.weights.method is "
                                          f"{self.method.value}")
        if isinstance(signal.version, bool) or not isinstance(signal.version, int) or signal.version < 0:
            raise Refused("bad-signal", f"version {signal.version!r} is not an integer >= 0")
        try:
            check_lineage(signal.lineage)
        except ValueError as exc:
            raise Refused("bad-signal", str(exc)) from None
        if signal.method == SyncMethod.COLLECTIVE:
            try:
                delivery = DeliveryState.parse(signal.state)
            except ValueError as exc:  # json.JSONDecodeError is one
                raise Refused("bad-signal", f"its delivery state: {exc}") from None
            if delivery.catch_up:
                self._check_location(self._catch_up_signal(signal, delivery))
        else:
            self._check_location(signal)

    def _check_location(self, signal: SyncSignal) -> None:
        """An object-store manifest may only be read with its sha256, and from this run's store."""
        if not is_sha256(signal.sha256):
            raise Refused("missing-sha256", f"sha256 {signal.sha256!r} is not 64 lowercase hex digits")
        check_manifest_uri(self.store_url, signal.uri, signal.version, signal.lineage)

    # -- loading ------------------------------------------------------------------------------------------
    def _load(self, signal: SyncSignal) -> bool:
        started = self._clock()
        try:
            self._precheck(signal)
            if signal.method == SyncMethod.OBJECT_STORE:
                version, tensors = signal.version, self._fetch_object_store(signal)
            else:
                version, tensors = self._fetch_broadcast(signal)
            self._swap(tensors, version)
        except Exception as exc:  # noqa: BLE001 - nothing a published signal or file holds may stop the worker
            self._refuse(signal, exc)
            return False
        self.refusals.loaded(signal)
        self._loaded = dataclasses.replace(signal, version=version)
        self.g_version.set(self.engine.version)
        logger.info("%s: swapped to weights v%d (lineage %s) in %.1fs", self.worker_id, version,
                    signal.lineage or "-", self._clock() - started)
        return True

    def _fetch_object_store(self, signal: SyncSignal):
        manifest = read_manifest(signal.uri, signal.sha256, expected_version=signal.version,
                                 expected_lineage=signal.lineage, storage_options=self.storage_options)
        self._check_payload(manifest.metadata)
        self._check_engine({name: entry.shape for name, entry in manifest.tensors.items()})  # before the download
        return load_weights(signal.uri, signal.sha256, manifest=manifest, storage_options=self.storage_options)

    def _fetch_broadcast(self, signal: SyncSignal):
        """The broadcast copy when this worker's receiver was in the group that carried it; else the catch-up
        copy the trainer published to the object store (a worker that joined late, or whose group broke)."""
        delivery = DeliveryState.parse(signal.state)
        receiver = self._receiver
        if receiver is not None and (receiver.ready.uri != signal.uri or receiver.ready.lineage != signal.lineage):
            receiver = None  # of an older trainer session
        if receiver is not None and receiver.member in delivery.receivers:
            received = receiver.wait(signal.version, timeout=self.collective_wait_s, epoch=delivery.epoch)
            if received is not None and self._verified(signal, delivery, *received):
                self._check_engine({name: tuple(t.shape) for name, t in received[1].items()})
                return received
        if delivery.catch_up:
            tensors = self._fetch_object_store(self._catch_up_signal(signal, delivery))
            self.c_caught_up.inc()
            logger.info("%s: v%d was not broadcast to this worker (epoch %d); caught up from the object store",
                        self.worker_id, signal.version, delivery.epoch)
            return signal.version, tensors
        if receiver is None:
            # the announcement may not have been followed yet (it is written first): retried
            raise Refused("no-group", f"no receiver in the group {signal.uri} of lineage "
                                      f"{signal.lineage or '-'}", transient=True)
        raise Refused("missed-broadcast", f"v{signal.version} went to epoch {delivery.epoch} without this worker "
                                          "and the trainer published no catch-up copy")

    def _verified(self, signal: SyncSignal, delivery: DeliveryState, version: int, tensors) -> bool:
        """Whether the broadcast copy is what the trainer announced (its digest): False sends the follower to
        the catch-up copy; with none, the version is refused (the worker waits for the next one)."""
        if version != signal.version:  # a newer broadcast whose signal is not read yet: nothing to check it by
            logger.info("%s: received v%d by broadcast while following v%d; taking v%d's catch-up copy",
                        self.worker_id, version, signal.version, signal.version)
            return False
        try:
            check_weights_digest(tensors, delivery.digest, version)
        except BroadcastIntegrityError as exc:
            if not delivery.catch_up:
                raise Refused("broadcast-integrity", str(exc)) from None
            self.refusals.c_refused.labels("broadcast-integrity").inc()
            logger.error("%s: %s; loading the catch-up copy instead — %s", self.worker_id, exc,
                         HINTS["broadcast-integrity"])
            return False
        return True

    @staticmethod
    def _catch_up_signal(signal: SyncSignal, delivery: DeliveryState) -> SyncSignal:
        return dataclasses.replace(signal, method=SyncMethod.OBJECT_STORE, uri=delivery.catch_up, state="")

    def _check_payload(self, metadata: dict[str, str]) -> None:
        """A manifest's tensors are an adapter exactly when this worker expects one, of its rank and scale."""
        published = _adapter_settings(metadata)
        if published is None and self.lora is None:
            return
        if published is None:
            raise Refused("incompatible-weights", "the version holds whole weights, but model.lora is set on this "
                                                  "worker (it merges adapters only)")
        if self.lora is None:
            raise Refused("incompatible-weights", "the version is a LoRA adapter, but model.lora is not set on "
                                                  "this worker")
        if (published.rank, published.alpha) != (self.lora.rank, self.lora.alpha):
            raise Refused("incompatible-weights", f"the adapter has rank {published.rank} and alpha "
                                                  f"{published.alpha}; model.lora here says rank {self.lora.rank} "
                                                  f"and alpha {self.lora.alpha}")

    def _check_engine(self, shapes) -> None:
        try:
            if self.merger is not None:
                shapes = self.merger.merged_shapes(shapes)
            self.engine.check_weights(shapes)
        except ValueError as exc:
            raise Refused("incompatible-weights", str(exc)) from exc

    def _swap(self, tensors, version: int) -> None:
        before = self.engine.version
        try:
            if self.merger is not None:
                tensors = self.merger.merge(dict(tensors))
            self.engine.load_weights(tensors, version)
        except ValueError as exc:  # engines check names/shapes/dtypes before changing anything
            raise Refused("incompatible-weights", str(exc)) from exc
        except Exception as exc:
            # not a refusal the engine checked for (e.g. out of memory while copying): its weights may be
            # partly replaced although it still reports the old version
            logger.error("%s: the engine failed while loading v%d and may serve partly replaced weights "
                         "(reports v%d)", self.worker_id, version, before, exc_info=True)
            raise Refused("engine-error", f"{type(exc).__name__}: {exc}") from exc

    # -- refusing (booked by ``refusals``) ------------------------------------------------------------------
    def _refuse(self, signal: SyncSignal, exc: BaseException) -> None:
        self.refusals.refuse(signal, exc, serving=self.engine.version)

    # -- collective -----------------------------------------------------------------------------------------
    def _follow_announcement(self, ready: SyncSignal) -> None:
        """Join the group a new NCCL_READY announces (replacing the receiver of an older one, whose thread ends
        at its trainer's farewell broadcast), if this run uses the collective transport and it is this run's."""
        if self.method != SyncMethod.COLLECTIVE:
            self._refuse(ready, Refused("wrong-method", "a weight-sync group was announced, but this run's "
                                                        "trainer.weights.method is object_store; not joining"))
            return
        try:
            check_lineage(ready.lineage)
            announced = check_announcement(ready, self.collective_host, self.collective_port)
        except ValueError as exc:
            self._refuse(ready, Refused("bad-announcement", str(exc)))
            return
        try:
            device = receiver_device(announced.backend, self.device)
        except ValueError as exc:
            self._refuse(ready, Refused("backend-unavailable", str(exc)))
            return
        if self._receiver is not None:
            self._receiver.close(timeout=0.1)  # leaves the older session's group (its thread ends with it)
        self._receiver = self._receiver_factory(ready, member=self.worker_id, host=self.collective_host,
                                                group_port=self.collective_port, device=device,
                                                timeout_s=self.receiver_timeout_s, secret=self.group_secret).start()
        logger.info("%s: joining the trainer's weight-sync group %s (lineage %s)", self.worker_id, ready.uri,
                    ready.lineage or "-")


class FollowedWeights:
    """A follower and the view of ``sync`` it follows, as the rollout core asks for weights
    (:class:`streamrft.engines.rollout.Weights`)."""

    def __init__(self, follower: WeightFollower, view: SyncView, stop: StopSignal) -> None:
        self.follower = follower
        self.view = view
        self.stop = stop

    @property
    def published(self) -> int:
        return self.view.version

    def serves(self, minimum: int) -> bool:
        return self.follower.serves(minimum, self.view)

    def newer_due(self) -> bool:
        return self.follower.newer_due(self.view)

    def swap_to_latest(self) -> bool:
        return self.follower.swap_to_latest(self.view)

    def refused(self, minimum: int) -> bool:
        return self.follower.refused(minimum, self.view)


def _adapter_settings(metadata: dict[str, str]) -> LoraSettings | None:
    """The LoRA settings a manifest's metadata declares (``LoraSettings.metadata``); None for whole weights."""
    if metadata.get(PAYLOAD_KEY) != ADAPTER_PAYLOAD:
        return None
    try:
        return LoraSettings(rank=int(metadata["lora_rank"]), alpha=float(metadata["lora_alpha"]),
                            target_modules=tuple(metadata["lora_target_modules"].split(",")))
    except (KeyError, ValueError) as exc:
        raise Refused("bad-manifest", f"the manifest says it holds an adapter but not its settings: {exc}") from exc
