"""What a rollout worker does with weights: decide which published version to serve, fetch it only from where
this run publishes, verify it, load it, and report what it refused. The worker calls, in its loop:

* :meth:`WeightFollower.follow` after each poll of ``sync`` (joins / replaces the collective receiver when the
  run uses ``trainer.weights.method: collective``; checks a newly announced version at once, so a forged one is
  reported without waiting for the worker to need it);
* :meth:`WeightFollower.swap_to_latest` when its sync style swaps as soon as a version appears;
* :meth:`WeightFollower.ensure_version` before a request that needs ``min_model_version``;
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
them, or whose group broke, loads that copy — checked like an object-store signal — instead of waiting.

Retries. Errors of the store itself (``OSError``: not reachable, not there yet, a timeout) are retried with a
backoff of 1 s doubling to 30 s, at most ``retry_attempts`` times per signal; any other refusal is final for
that signal (same lineage, version, method, URI and sha256 — a forged signal cannot pre-empt the real one of
the same version).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from streamrft.config import RunConfig
from streamrft.engines.inference import InferenceEngine
from streamrft.engines.lora import ADAPTER_PAYLOAD, PAYLOAD_KEY, AdapterMerger, LoraSettings, read_base_weights
from streamrft.engines.weights import (
    ChecksumRequiredError,
    ForeignUriError,
    ManifestIntegrityError,
    ManifestMismatchError,
    ShardIntegrityError,
    UnsafeShardNameError,
    WeightFormatError,
    check_lineage,
    check_manifest_uri,
    is_sha256,
    load_weights,
    read_manifest,
)
from streamrft.engines.weights.elastic import parse_delivery_state
from streamrft.lifecycle import StopSignal
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal
from streamrft.sync import SyncView, supersedes  # the one rule of which weights are newer; re-exported here

from .model_paths import resolve_model_path
from .weight_sync import CollectiveReceiver, check_announcement, receiver_device

logger = logging.getLogger(__name__)

__all__ = ["HINTS", "FollowedWeights", "Refusal", "WeightFollower", "supersedes"]

_METHODS = {"object_store": SyncMethod.OBJECT_STORE, "collective": SyncMethod.COLLECTIVE}

# reason -> what to do about it (the second half of every refusal's log line)
HINTS: dict[str, str] = {
    "wrong-method": "workers load only the configured transport: give trainer and workers the same "
                    "trainer.weights.method",
    "bad-signal": "the signal is not one a streamrft trainer writes; check who produces to the sync topic",
    "foreign-uri": "weights are loaded only from this run's trainer.weights.url: give trainer and workers the "
                   "same url, and check who produces to the sync topic",
    "missing-sha256": "a WEIGHTS_PUBLISHED must carry the manifest's sha256 (ObjectStore.publish returns it)",
    "version-mismatch": "the manifest is of another version or lineage than announced; check who writes to "
                        "the weights store",
    "unsafe-shard-name": "the manifest names a shard outside its version directory; check who writes to the "
                         "weights store",
    "integrity": "the manifest or a shard changed after it was announced (or is partly written); the next "
                 "published version will be tried",
    "bad-manifest": "the manifest is not a valid streamrft manifest; check who writes to the weights store",
    "incompatible-weights": "the weights do not fit this engine's model (names/shapes): give trainer and "
                            "workers the same model.path and model.lora",
    "engine-error": "the engine failed while loading; see the traceback in the log",
    "store-unavailable": "the fsspec backend for the store's protocol is not installed on this worker",
    "unreachable": "the store (or the weight-sync group) did not answer; retried with backoff",
    "no-group": "the weights were broadcast to a weight-sync group this worker has not joined",
    "missed-broadcast": "this worker was not in the group when the version was broadcast; set "
                        "trainer.weights.catch_up: object_store so that it can catch up (it takes the next one)",
    "bad-announcement": "the NCCL_READY does not describe a group of this run (trainer.weights.collective_host "
                        "/ collective_port); check who produces to the sync topic",
    "backend-unavailable": "the trainer's weight-sync group uses a backend this worker's devices cannot join",
    "load-error": "reading the published weights failed; see the traceback in the log",
}


@dataclass(frozen=True)
class Refusal:
    """A weight signal that was not (or not yet) followed. ``transient``: it is being retried."""

    signal: SyncSignal
    reason: str
    detail: str
    transient: bool


class _Refused(Exception):
    def __init__(self, reason: str, detail: str, transient: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.transient = transient


def _identity(signal: SyncSignal) -> tuple:
    return (signal.kind, signal.lineage, signal.version, signal.method, signal.uri, signal.sha256, signal.state)


def _describe(signal: SyncSignal) -> str:
    return (f"{signal.kind.value} v{signal.version} (lineage {signal.lineage or '-'}, method "
            f"{signal.method.value}, uri {signal.uri!r}, from {signal.source or '?'})")


@dataclass
class _Retry:
    attempts: int
    next_at: float


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
        self.collective_host = weights.collective_host
        self.collective_port = weights.collective_port
        self.receiver_timeout_s = weights.receiver_timeout_s
        self.device = config.rollout.device  # only where NCCL receives (see receiver_device)
        self.retry_initial_s, self.retry_max_s, self.retry_attempts = retry_initial_s, retry_max_s, retry_attempts
        self.collective_wait_s = collective_wait_s
        self._clock = clock
        self._receiver_factory = receiver_factory
        self._receiver: CollectiveReceiver | None = None
        self._announcement: tuple | None = None  # identity of the last NCCL_READY acted on
        self._noted: tuple | None = None  # identity of the last WEIGHTS_PUBLISHED prechecked by follow()
        self._loaded: SyncSignal | None = None  # what the engine serves; None = the weights it was built with
        self._final: OrderedDict[tuple, None] = OrderedDict()  # refused for good (bounded, oldest forgotten)
        self._retries: dict[tuple, _Retry] = {}
        self._refusals: list[Refusal] = []
        self.c_refused = Counter("streamrft_rollout_weights_refused", "weight versions refused (every attempt), "
                                 "by reason", ["reason"], registry=registry)
        self.c_caught_up = Counter("streamrft_rollout_weights_caught_up", "collective versions this worker missed "
                                   "by broadcast and loaded from the object store", registry=registry)
        self.g_version = Gauge("streamrft_rollout_model_version", "weights version loaded", registry=registry)
        self.g_version.set(engine.version)

    # -- the worker's calls -------------------------------------------------------------------------------
    def follow(self, view: SyncView) -> None:
        """After each poll of ``sync``: act on a new NCCL_READY, and precheck a new WEIGHTS_PUBLISHED (no
        fetch) so that a forged one is refused and reported now."""
        ready = view.collective_ready
        if ready is not None and _identity(ready) != self._announcement:
            self._announcement = _identity(ready)
            self._follow_announcement(ready)
        latest = view.weights
        if latest is not None and _identity(latest) != self._noted:
            self._noted = _identity(latest)
            if supersedes(self._loaded, latest) and _identity(latest) not in self._final:
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

    def ensure_version(self, minimum: int, view: SyncView, stop: StopSignal, timeout_s: float) -> bool:
        """Wait until the engine serves at least ``minimum`` of the current lineage (polling ``view`` every
        0.5 s). False, with the reason logged, on timeout, on stop, or when the version needed was refused."""
        deadline = self._clock() + timeout_s
        waited = False
        while True:
            if self._serves(minimum, view):
                return True
            self.swap_to_latest(view)
            if self._serves(minimum, view):
                return True
            latest = view.weights
            if latest is not None and latest.version >= minimum and _identity(latest) in self._final:
                logger.error("%s: weights v%d are needed but %s was refused; serving v%d", self.worker_id,
                             minimum, _describe(latest), self.engine.version)
                return False
            if stop.requested or self._clock() >= deadline:
                if not stop.requested:
                    logger.error("%s: weights v%d not served within %.0fs (have v%d, newest announced: %s)",
                                 self.worker_id, minimum, timeout_s, self.engine.version,
                                 _describe(latest) if latest else "none")
                return False
            if not waited:
                logger.info("%s: waiting for weights v%d (have v%d)", self.worker_id, minimum, self.engine.version)
                waited = True
            view.poll(0.5)
            self.follow(view)

    def take_refusals(self) -> list[Refusal]:
        refusals, self._refusals = self._refusals, []
        return refusals

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
        if signal.kind != SyncKind.WEIGHTS_PUBLISHED or not supersedes(self._loaded, signal):
            return False
        key = _identity(signal)
        if key in self._final:
            return False
        retry = self._retries.get(key)
        return retry is None or self._clock() >= retry.next_at

    def _precheck(self, signal: SyncSignal) -> None:
        """Everything that can be refused from the signal alone, before any I/O."""
        if signal.kind != SyncKind.WEIGHTS_PUBLISHED:
            raise _Refused("bad-signal", f"kind {signal.kind.value} does not announce weights")
        if signal.method != self.method:
            raise _Refused("wrong-method", f"method {signal.method.value}; this run's trainer.weights.method is "
                                           f"{self.method.value}")
        if isinstance(signal.version, bool) or not isinstance(signal.version, int) or signal.version < 0:
            raise _Refused("bad-signal", f"version {signal.version!r} is not an integer >= 0")
        try:
            check_lineage(signal.lineage)
        except ValueError as exc:
            raise _Refused("bad-signal", str(exc)) from None
        if signal.method == SyncMethod.COLLECTIVE:
            try:
                delivery = parse_delivery_state(signal.state)
            except ValueError as exc:  # json.JSONDecodeError is one
                raise _Refused("bad-signal", f"its delivery state: {exc}") from None
            if delivery.catch_up:
                self._check_location(self._catch_up_signal(signal, delivery))
        else:
            self._check_location(signal)

    def _check_location(self, signal: SyncSignal) -> None:
        """An object-store manifest may only be read with its sha256, and from this run's store."""
        if not is_sha256(signal.sha256):
            raise _Refused("missing-sha256", f"sha256 {signal.sha256!r} is not 64 lowercase hex digits")
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
        self._retries.pop(_identity(signal), None)
        self._loaded = dataclasses.replace(signal, version=version)
        self.g_version.set(self.engine.version)
        logger.info("%s: swapped to weights v%d (lineage %s) in %.1fs", self.worker_id, version,
                    signal.lineage or "-", self._clock() - started)
        return True

    def _fetch_object_store(self, signal: SyncSignal):
        manifest = read_manifest(signal.uri, signal.sha256, expected_version=signal.version,
                                 expected_lineage=signal.lineage)
        self._check_payload(manifest.metadata)
        self._check_engine({name: entry.shape for name, entry in manifest.tensors.items()})  # before the download
        return load_weights(signal.uri, signal.sha256, manifest=manifest)

    def _fetch_broadcast(self, signal: SyncSignal):
        """The broadcast copy when this worker's receiver was in the group that carried it; else the catch-up
        copy the trainer published to the object store (a worker that joined late, or whose group broke)."""
        delivery = parse_delivery_state(signal.state)
        receiver = self._receiver
        if receiver is not None and (receiver.ready.uri != signal.uri or receiver.ready.lineage != signal.lineage):
            receiver = None  # of an older trainer session
        if receiver is not None and receiver.member in delivery.receivers:
            received = receiver.wait(signal.version, timeout=self.collective_wait_s, epoch=delivery.epoch)
            if received is not None:
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
            raise _Refused("no-group", f"no receiver in the group {signal.uri} of lineage "
                                       f"{signal.lineage or '-'}", transient=True)
        raise _Refused("missed-broadcast", f"v{signal.version} went to epoch {delivery.epoch} without this worker "
                                           "and the trainer published no catch-up copy")

    @staticmethod
    def _catch_up_signal(signal: SyncSignal, delivery) -> SyncSignal:
        return dataclasses.replace(signal, method=SyncMethod.OBJECT_STORE, uri=delivery.catch_up, state="")

    def _check_payload(self, metadata: dict[str, str]) -> None:
        """A manifest's tensors are an adapter exactly when this worker expects one, of its rank and scale."""
        published = _adapter_settings(metadata)
        if published is None and self.lora is None:
            return
        if published is None:
            raise _Refused("incompatible-weights", "the version holds whole weights, but model.lora is set on this "
                                                   "worker (it merges adapters only)")
        if self.lora is None:
            raise _Refused("incompatible-weights", "the version is a LoRA adapter, but model.lora is not set on "
                                                   "this worker")
        if (published.rank, published.alpha) != (self.lora.rank, self.lora.alpha):
            raise _Refused("incompatible-weights", f"the adapter has rank {published.rank} and alpha "
                                                   f"{published.alpha}; model.lora here says rank {self.lora.rank} "
                                                   f"and alpha {self.lora.alpha}")

    def _check_engine(self, shapes) -> None:
        try:
            if self.merger is not None:
                shapes = self.merger.merged_shapes(shapes)
            self.engine.check_weights(shapes)
        except ValueError as exc:
            raise _Refused("incompatible-weights", str(exc)) from exc

    def _swap(self, tensors, version: int) -> None:
        before = self.engine.version
        try:
            if self.merger is not None:
                tensors = self.merger.merge(dict(tensors))
            self.engine.load_weights(tensors, version)
        except ValueError as exc:  # engines check names/shapes/dtypes before changing anything
            raise _Refused("incompatible-weights", str(exc)) from exc
        except Exception as exc:
            # not a refusal the engine checked for (e.g. out of memory while copying): its weights may be
            # partly replaced although it still reports the old version
            logger.error("%s: the engine failed while loading v%d and may serve partly replaced weights "
                         "(reports v%d)", self.worker_id, version, before, exc_info=True)
            raise _Refused("engine-error", f"{type(exc).__name__}: {exc}") from exc

    # -- refusing -----------------------------------------------------------------------------------------
    def _refuse(self, signal: SyncSignal, exc: BaseException) -> None:
        reason, transient = _classify(exc)
        detail = str(exc) or type(exc).__name__
        key = _identity(signal)
        self.c_refused.labels(reason).inc()
        if transient:
            retry = self._retries.get(key) or _Retry(0, 0.0)
            retry.attempts += 1
            if retry.attempts < self.retry_attempts:
                delay = min(self.retry_max_s, self.retry_initial_s * 2 ** (retry.attempts - 1))
                retry.next_at = self._clock() + delay
                self._retries[key] = retry
                logger.warning("%s: %s not loaded (%s: %s); retry %d/%d in %.0fs — %s", self.worker_id,
                               _describe(signal), reason, detail, retry.attempts, self.retry_attempts - 1, delay,
                               HINTS[reason])
                if retry.attempts == 1:  # reported once, not at every retry
                    self._refusals.append(Refusal(signal, reason, detail, transient=True))
                return
            detail = f"gave up after {retry.attempts} attempts: {detail}"
        self._retries.pop(key, None)
        self._final[key] = None
        while len(self._final) > 1024:
            self._final.popitem(last=False)
        logger.error("%s: %s refused (%s: %s); serving v%d — %s", self.worker_id, _describe(signal), reason,
                     detail, self.engine.version, HINTS[reason], exc_info=reason in ("load-error", "engine-error"))
        self._refusals.append(Refusal(signal, reason, detail, transient=False))

    # -- collective -----------------------------------------------------------------------------------------
    def _follow_announcement(self, ready: SyncSignal) -> None:
        """Join the group a new NCCL_READY announces (replacing the receiver of an older one, whose thread ends
        at its trainer's farewell broadcast), if this run uses the collective transport and it is this run's."""
        if self.method != SyncMethod.COLLECTIVE:
            self._refuse(ready, _Refused("wrong-method", "a weight-sync group was announced, but this run's "
                                                         "trainer.weights.method is object_store; not joining"))
            return
        try:
            check_lineage(ready.lineage)
            state = check_announcement(ready, self.collective_host, self.collective_port)
        except ValueError as exc:  # json.JSONDecodeError is one
            self._refuse(ready, _Refused("bad-announcement", str(exc)))
            return
        try:
            device = receiver_device(state["backend"], self.device)
        except ValueError as exc:
            self._refuse(ready, _Refused("backend-unavailable", str(exc)))
            return
        if self._receiver is not None:
            self._receiver.close(timeout=0.1)  # leaves the older session's group (its thread ends with it)
        self._receiver = self._receiver_factory(ready, member=self.worker_id, host=self.collective_host,
                                                group_port=self.collective_port, device=device,
                                                timeout_s=self.receiver_timeout_s).start()
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

    def ensure(self, minimum: int, timeout_s: float) -> bool:
        return self.follower.ensure_version(minimum, self.view, self.stop, timeout_s)


def _adapter_settings(metadata: dict[str, str]) -> LoraSettings | None:
    """The LoRA settings a manifest's metadata declares (``LoraSettings.metadata``); None for whole weights."""
    if metadata.get(PAYLOAD_KEY) != ADAPTER_PAYLOAD:
        return None
    try:
        return LoraSettings(rank=int(metadata["lora_rank"]), alpha=float(metadata["lora_alpha"]),
                            target_modules=tuple(metadata["lora_target_modules"].split(",")))
    except (KeyError, ValueError) as exc:
        raise _Refused("bad-manifest", f"the manifest says it holds an adapter but not its settings: {exc}") from exc


def _classify(exc: BaseException) -> tuple[str, bool]:
    """(reason, transient) of an exception raised while checking, fetching or loading weights."""
    if isinstance(exc, _Refused):
        return exc.reason, exc.transient
    for kind, reason in ((ForeignUriError, "foreign-uri"), (ChecksumRequiredError, "missing-sha256"),
                         (ManifestMismatchError, "version-mismatch"), (UnsafeShardNameError, "unsafe-shard-name"),
                         (ManifestIntegrityError, "integrity"), (ShardIntegrityError, "integrity"),
                         (WeightFormatError, "bad-manifest")):
        if isinstance(exc, kind):
            return reason, False
    if isinstance(exc, OSError):  # the store: not reachable, not there (yet), timed out — TimeoutError included
        return "unreachable", True
    if isinstance(exc, ImportError):
        return "store-unavailable", False
    return "load-error", False
