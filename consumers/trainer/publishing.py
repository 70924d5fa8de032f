"""The trainer's side of the weights: the primary trainer publishes them when pacing says so (upload or
broadcast first, then ``WEIGHTS_PUBLISHED``, with a SYNC_REQUEST under ``trainer_driven`` when one is due) and
once more at the end; a fan-out or replay trainer publishes none.

Weight transports (``trainer.weights.method``, ``streamrft.weights.publishers``):

* ``object_store``: safetensors shards + manifest under ``weights_url``; the signal carries the manifest URI and
  sha256, and rollout workers verify before they swap.
* ``collective``: torch.distributed broadcast (gloo on CPU, NCCL on GPU) to an elastic group
  (``engines.weights.elastic``): the trainer hosts a membership store and publishes ``NCCL_READY`` once (uri =
  the store's ``tcp://`` address; state = ``{"session", "receivers", "bucket_bytes", "backend"}``); workers
  register there whenever they start and leave when they stop. At each sync the trainer re-forms the group (a
  new epoch) if membership changed, broadcasts, publishes the same version to the object store for whoever
  missed it (``trainer.weights.catch_up``), and only then publishes ``WEIGHTS_PUBLISHED(method=COLLECTIVE)``
  whose state says which epoch carried it to whom and where the catch-up copy is. A receiver that dies or hangs
  holds a sync up for at most ``trainer.weights.receiver_timeout_s`` per phase; the group then goes on
  without it. At the end the trainer marks the store closed and says farewell (an empty version −1).
"""
from __future__ import annotations

import logging
import time

from streamrft.config import RunConfig
from streamrft.engines.training import TrainingEngine
from streamrft.engines.training.ranks import RankZeroEngine
from streamrft.pacing import Pacing
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.schemas import SyncKind, SyncSignal
from streamrft.sync import SyncView
from streamrft.weights.publishers import CollectivePublisher, ObjectStorePublisher

logger = logging.getLogger(__name__)


class WeightsPublishing:
    def __init__(self, config: RunConfig, runtime: RoleRuntime, engine: TrainingEngine | RankZeroEngine,
                 source: str, *, primary: bool):
        self.topic = config.topic("sync")
        self.pacing = Pacing.of(config)
        self.source = source
        self.engine = engine
        self.published_version = -1
        self.publisher: CollectivePublisher | ObjectStorePublisher | None = None
        if primary:
            collective = config.trainer.weights.method == "collective"
            self.publisher = (CollectivePublisher(config, engine.device, source) if collective
                              else ObjectStorePublisher(config, source))
            runtime.on_close("weights publisher", self.publisher.close)

    def due(self, version: int) -> bool:
        """Whether the weights are published once they are ``version`` (every ``sync.interval`` steps)."""
        return self.publisher is not None and self.pacing.publishes_at(version)

    def final_due(self, version: int) -> bool:
        """At the end: whether ``version`` is newer than what was published last."""
        return self.publisher is not None and version > max(self.published_version, 0)

    def publish(self, version: int, unit: UnitOfWork) -> dict[str, float]:
        """Upload (or broadcast) the weights now; their signals go with the unit. Returns the metrics of it."""
        started = time.monotonic()
        signal = self.publisher.publish(self.engine, version)
        self.published_version = version
        unit.produce(self.topic, signal)
        if self.pacing.sync_request_due(signal.version):
            # trainer_driven: ask the workers to move to this version; the explorer paces on these requests,
            # not on the versions published in between (which bench and eval can still use)
            unit.produce(self.topic, SyncSignal(kind=SyncKind.SYNC_REQUEST, version=signal.version,
                                                source=self.source, lineage=signal.lineage))
        metrics = {"time/publish_weights": time.monotonic() - started}
        delivery = getattr(self.publisher, "last_delivery", None)
        if delivery is not None:  # collective: how many receivers got it by broadcast, in which epoch
            metrics["weights/broadcast_receivers"] = float(len(delivery.receivers))
            metrics["weights/epoch"] = float(delivery.epoch)
            metrics["weights/broadcast_failed"] = float(bool(delivery.failure))
        return metrics

    def announce(self, unit: UnitOfWork, sync: SyncView, version: int) -> None:
        """At the start: the collective group's NCCL_READY (once), and a warning when ``sync`` holds weights newer
        than the resumed ``version``."""
        if self.publisher is None:
            return
        announcement = self.publisher.announcement()
        if announcement is not None:
            unit.produce(self.topic, announcement)
            unit.describe("NCCL_READY")
            logger.info("%s: weight-sync membership store at %s; the first broadcast waits for %d receiver(s)",
                        self.source, announcement.uri, self.publisher.expected_receivers)
        if sync.version > version:
            logger.warning("%s: weights v%d on %s are newer than the resumed v%d: that training was lost with the "
                           "process; versions up to v%d are published again from this lineage", self.source,
                           sync.version, sync.topic, version, sync.version)
