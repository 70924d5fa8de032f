"""The trainer's side of the weights: publish a version (to the object store, or by broadcast to the weight-sync
group with an object-store copy for whoever missed it) and return the ``sync`` signal that announces it.

Each publisher is one trainer lifetime and has its own *lineage* id (``new_lineage``), put in every signal it
sends: a trainer that resumes from an older checkpoint publishes versions it had published before, and workers
follow it because the lineage changed (``streamrft.sync.supersedes``)."""
from __future__ import annotations

import logging
import uuid

import torch

from streamrft.config import RunConfig
from streamrft.engines.training import TrainingEngine
from streamrft.engines.weights.collective import backend_for
from streamrft.engines.weights.elastic import Delivery, ElasticSender
from streamrft.engines.weights.locations import new_lineage
from streamrft.engines.weights.object_store import ObjectStore
from streamrft.engines.weights.signal_state import Announcement, DeliveryState
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal

logger = logging.getLogger(__name__)


class ObjectStorePublisher:
    """Uploads a version, then returns the signal that announces it (never before the upload is complete)."""

    def __init__(self, config: RunConfig, source: str):
        w = config.trainer.weights
        self.lineage = new_lineage()
        self.store = ObjectStore(config.weights_url, lineage=self.lineage, keep_last=w.keep_last,
                                 max_shard_bytes=w.shard_mb << 20, storage_options=w.storage_options())
        self.source = source

    def announcement(self) -> SyncSignal | None:
        return None

    def publish(self, engine: TrainingEngine, version: int) -> SyncSignal:
        published = self.store.publish(engine.named_weights(), version=version, metadata=engine.publish_metadata())
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.OBJECT_STORE,
                          uri=published.uri, sha256=published.sha256, nbytes=published.nbytes, source=self.source,
                          lineage=self.lineage)

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
        secret = w.group_secret.get_secret_value().encode() if w.group_secret else None
        if secret is None:
            logger.warning("%s: trainer.weights.group_secret is not set: any process that reaches the weight-sync "
                           "membership store on %s may join the group (what it receives is still checked against "
                           "the digest in each signal). Set the same secret on the trainer and every worker "
                           "(streamrft run makes one per run)", source, w.collective_host)
        # both stores listen on collective_host only (loopback by default), never on every interface
        self.sender = ElasticSender(w.collective_host, self.session, device=device,
                                    port=w.collective_port + 1 if w.collective_port else 0,
                                    group_port=w.collective_port, timeout_s=w.receiver_timeout_s, secret=secret)
        self.catch_up = (ObjectStore(config.weights_url, lineage=self.lineage, keep_last=w.keep_last,
                                     max_shard_bytes=w.shard_mb << 20, storage_options=w.storage_options())
                         if w.catch_up == "object_store" else None)
        self.last_delivery: Delivery | None = None
        self._first = True

    def announcement(self) -> SyncSignal:
        """NCCL_READY: where the membership store is. Receivers register there from now on."""
        # the backend is the trainer's to choose (its device); receivers follow it, whatever their own device
        state = Announcement(session=self.session, receivers=self.expected_receivers, bucket_bytes=self.bucket_bytes,
                             backend=backend_for(self.device))
        return SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE,
                          uri=self.sender.address, source=self.source, state=state.to_json(), lineage=self.lineage)

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
        state = DeliveryState(delivery.epoch, delivery.receivers, catch_up.uri if catch_up else "",
                              delivery.stats.digest if delivery.stats else "")
        return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.COLLECTIVE,
                          uri=self.sender.address, nbytes=nbytes, sha256=catch_up.sha256 if catch_up else "",
                          source=self.source, lineage=self.lineage, state=state.to_json())

    def close(self) -> None:
        self.sender.close()
