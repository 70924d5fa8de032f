"""What the weight follower refused, and why: the reasons (each with what to do about it, :data:`HINTS`), how an
exception raised while checking, fetching or loading a version becomes one (:func:`classify`), and the book of
refused signals (:class:`Refusals`): refused for good, or retried with a backoff while the store does not answer.

A signal is known by all it says (:func:`identity`: lineage, version, method, URI, sha256, state): a forged
signal refused for good cannot pre-empt the real one of the same version."""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from streamrft.engines.weights.errors import (
    ChecksumRequiredError,
    ForeignUriError,
    ManifestIntegrityError,
    ManifestMismatchError,
    ShardIntegrityError,
    UnsafeShardNameError,
    WeightFormatError,
)
from streamrft.metric_catalog import prometheus_metric
from streamrft.schemas import SyncSignal

logger = logging.getLogger(__name__)

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
    "broadcast-integrity": "the weights received by broadcast do not match the digest the trainer announced "
                           "(changed on the way, or sent by a member that is not the trainer): the catch-up copy "
                           "is loaded if there is one, else the next version; check who can reach "
                           "trainer.weights.collective_host and set trainer.weights.group_secret",
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


class Refused(Exception):
    """A refusal the follower decided itself, with its reason (a key of :data:`HINTS`)."""

    def __init__(self, reason: str, detail: str, transient: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.transient = transient


def identity(signal: SyncSignal) -> tuple:
    return (signal.kind, signal.lineage, signal.version, signal.method, signal.uri, signal.sha256, signal.state)


def describe(signal: SyncSignal) -> str:
    return (f"{signal.kind.value} v{signal.version} (lineage {signal.lineage or '-'}, method "
            f"{signal.method.value}, uri {signal.uri!r}, from {signal.source or '?'})")


def classify(exc: BaseException) -> tuple[str, bool]:
    """(reason, transient) of an exception raised while checking, fetching or loading weights."""
    if isinstance(exc, Refused):
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


@dataclass
class _Retry:
    attempts: int
    next_at: float


class Refusals:
    """The signals refused for good (the newest 1024), those to retry (a backoff of ``retry_initial_s``
    doubling to ``retry_max_s``, at most ``retry_attempts`` tries), and the refusals not yet taken (each
    transient one is reported once, not at every retry)."""

    def __init__(self, worker_id: str, registry: CollectorRegistry, *, retry_initial_s: float, retry_max_s: float,
                 retry_attempts: int, clock: Callable[[], float]):
        self.worker_id = worker_id
        self.retry_initial_s, self.retry_max_s, self.retry_attempts = retry_initial_s, retry_max_s, retry_attempts
        self._clock = clock
        self._final: OrderedDict[tuple, None] = OrderedDict()
        self._retries: dict[tuple, _Retry] = {}
        self._pending: list[Refusal] = []
        self.c_refused = prometheus_metric("streamrft_rollout_weights_refused", registry)

    def final(self, signal: SyncSignal) -> bool:
        """Whether ``signal`` was refused for good."""
        return identity(signal) in self._final

    def due(self, signal: SyncSignal) -> bool:
        """Whether ``signal`` may be tried now: never refused for good, and its retry (if any) is due."""
        key = identity(signal)
        if key in self._final:
            return False
        retry = self._retries.get(key)
        return retry is None or self._clock() >= retry.next_at

    def loaded(self, signal: SyncSignal) -> None:
        self._retries.pop(identity(signal), None)

    def refuse(self, signal: SyncSignal, exc: BaseException, serving: int) -> None:
        """Book the refusal of ``signal`` because of ``exc`` (``serving``: the version the engine keeps)."""
        reason, transient = classify(exc)
        detail = str(exc) or type(exc).__name__
        key = identity(signal)
        self.c_refused.labels(reason).inc()
        if transient:
            retry = self._retries.get(key) or _Retry(0, 0.0)
            retry.attempts += 1
            if retry.attempts < self.retry_attempts:
                delay = min(self.retry_max_s, self.retry_initial_s * 2 ** (retry.attempts - 1))
                retry.next_at = self._clock() + delay
                self._retries[key] = retry
                logger.warning("%s: %s not loaded (%s: %s); retry %d/%d in %.0fs — %s", self.worker_id,
                               describe(signal), reason, detail, retry.attempts, self.retry_attempts - 1, delay,
                               HINTS[reason])
                if retry.attempts == 1:
                    self._pending.append(Refusal(signal, reason, detail, transient=True))
                return
            detail = f"gave up after {retry.attempts} attempts: {detail}"
        self._retries.pop(key, None)
        self._final[key] = None
        while len(self._final) > 1024:
            self._final.popitem(last=False)
        logger.error("%s: %s refused (%s: %s); serving v%d — %s", self.worker_id, describe(signal), reason,
                     detail, serving, HINTS[reason], exc_info=reason in ("load-error", "engine-error"))
        self._pending.append(Refusal(signal, reason, detail, transient=False))

    def take(self) -> list[Refusal]:
        """The refusals booked since the last call (to dead-letter and count)."""
        pending, self._pending = self._pending, []
        return pending
