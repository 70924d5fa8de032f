"""A trainer's line of checkpoints: where it starts reading, and each checkpoint after.

It resumes from the newest checkpoint: seeks to *its* offsets (not the group's committed ones) and hands back its
buffer, so nothing is trained twice or skipped; a group whose offsets someone else reset since stops it, or, with
``--accept-offset-reset``, sends those partitions to the group's offsets (``group_offsets.py``). Without one, a new
lineage starts at the replay point, the group's committed offsets or the beginning, recorded in a step-0
checkpoint (no weights). ``trained.jsonl`` in
the checkpoint directory lists the eids of every step of the surviving lineage.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from streamrft.errors import ConfigError
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Delivered, Offsets, RecordConsumer
from streamrft.schemas import Experience, InvalidRecordError, SingleObjectCodec

from .checkpoints import Checkpoints
from .group_offsets import GroupOffsets
from .mix import SupervisedMix
from .replay import ReplayStart

logger = logging.getLogger(__name__)


@dataclass
class Start:
    """What a trainer starts from: the steps done, the weights last published, the experiences read but not
    trained, and the checkpoint whose engine state it loads (None: the base model)."""

    step: int = 0
    published_version: int = -1
    buffered: tuple[Delivered[Experience], ...] = ()
    engine_state: Path | None = None


class Lineage:
    def __init__(self, checkpoints: Checkpoints, clients: KafkaClients, consumer: RecordConsumer, *, source: str,
                 model_path: str, replay: ReplayStart | None, mix: SupervisedMix | None,
                 check: Callable[[Experience], None], group_offsets: GroupOffsets):
        self.checkpoints = checkpoints
        self.group_offsets = group_offsets
        self.clients = clients
        self.consumer = consumer
        self.topic = consumer.topics[0]
        self.source = source
        self.model_path = model_path
        self.replay = replay
        self.mix = mix
        self.check = check  # of what a checkpoint holds: one written before a check existed may hold a bad record
        self.codec = SingleObjectCodec()  # checkpointed experiences: registry-independent single-object bytes
        self.checkpointed_step = -1

    def start(self) -> Start:
        """Assign the readers where the lineage goes on (or begins) and say what it starts from."""
        partitions = self.clients.offsets(self.topic, "start")
        latest = self.checkpoints.latest()
        if latest is not None and self.replay is not None:
            raise ConfigError(
                f"--replay-from {self.replay}: {self.checkpoints.root} already holds checkpoints (newest "
                f"{latest.name}); a replay starts a new lineage: give it its own --group, remove that directory, "
                "or drop --replay-from to resume")
        if latest is not None:
            return self._resume(latest, partitions)
        return self._origin(partitions)

    def reload(self) -> Start:
        """Go back to the newest checkpoint (a unit could not commit; see ``Trainer.rejoin``): the readers seek to
        its offsets and its buffer is handed back, as at a restart, whatever ``--replay-from`` said at start."""
        return self._resume(self.checkpoints.latest(), self.clients.offsets(self.topic, "start"))

    def save(self, step: int, write_engine: Callable[[Path], None], buffered: list[Delivered[Experience]],
             published_version: int) -> None:
        """A checkpoint of ``step``: the engine's state, the readers' positions and what they hold untrained."""
        if step == self.checkpointed_step:
            return  # that step's checkpoint is a consistent snapshot already; later reads are simply re-read
        started = time.monotonic()
        entries = [{"topic": i.topic, "partition": i.partition, "offset": i.offset, "timestamp_ms": i.timestamp_ms,
                    "value": self.codec.encode(i.record)} for i in buffered]
        path = self.checkpoints.save(step, write_engine, self.consumer.positions(), entries,
                                     self._meta(published_version))
        self.checkpointed_step = step
        self.group_offsets.checkpointed(step)
        logger.info("%s: checkpoint %s (%d buffered) in %.1fs", self.source, path, len(entries),
                    time.monotonic() - started)

    def _resume(self, path: Path, partitions: Offsets) -> Start:
        checkpoint = self.checkpoints.load(path)
        positions = {tp: checkpoint.offsets.get(tp, low) for tp, low in partitions.items()}
        elsewhere = self.group_offsets.resume(checkpoint.step, positions)  # a reset accepted, or OffsetReset
        removed = self.checkpoints.truncate_audit(checkpoint.step)
        self.consumer.assign({**positions, **elsewhere})
        buffered = [e for e in checkpoint.buffered if (e["topic"], int(e["partition"])) not in elsewhere]
        if self.mix is not None:
            self.mix.assign(partitions, SupervisedMix.saved_offsets(checkpoint.meta))
        self.checkpointed_step = checkpoint.step
        logger.info("%s: resuming from %s: %d steps done (weights v%d), %d buffered experience(s), %d audit "
                    "entr%s of lost steps removed", self.source, path, checkpoint.step, checkpoint.step,
                    len(buffered), removed, "y" if removed == 1 else "ies")
        if elsewhere:
            logger.warning("%s: reading from the group's offsets, not the checkpoint's: %s (%d buffered "
                           "experience(s) of those partitions left to be read again)", self.source,
                           ", ".join(f"[{p}]@{o} (checkpoint @{positions[(t, p)]})"
                                     for (t, p), o in sorted(elsewhere.items())),
                           len(checkpoint.buffered) - len(buffered))
        return Start(checkpoint.step, int(checkpoint.meta.get("published_version", -1)),
                     tuple(self._restored(buffered)), checkpoint.path if checkpoint.has_model else None)

    def _restored(self, entries: list[dict]) -> Iterator[Delivered[Experience]]:
        for entry in entries:
            record = self.codec.decode(entry["value"], Experience)
            try:
                self.check(record)
            except InvalidRecordError as exc:
                logger.warning("%s: buffered experience %s from the checkpoint skipped: %s", self.source,
                               record.eid, exc)
                continue
            yield Delivered(record, entry["topic"], int(entry["partition"]), int(entry["offset"]), record.group_id,
                            int(entry.get("timestamp_ms", 0)))

    def _origin(self, partitions: Offsets) -> Start:
        if self.replay is not None and self.replay.offset is not None:
            ends = self.clients.offsets(self.topic, "end")
            offsets = {tp: min(max(self.replay.offset, low), ends[tp]) for tp, low in partitions.items()}
            origin = f"replay from {self.replay}"
        elif self.replay is not None:
            offsets = self.clients.offsets_for_time(self.topic, self.replay.timestamp_ms)
            origin = f"replay from {self.replay}"
        else:
            committed = self.clients.committed(self.consumer.group_id, self.topic)
            offsets = {tp: max(committed.get(tp, low), low) for tp, low in partitions.items()}
            origin = "the group's committed offsets" if committed else "the beginning"
        self.checkpoints.truncate_audit(0)
        if self.mix is not None:
            self.mix.assign(partitions, offsets if self.replay is not None else None)
        self.checkpoints.save(0, None, offsets, [], {**self._meta(-1), "origin": True})  # the base model, no weights
        self.checkpointed_step = 0
        self.group_offsets.begin(list(partitions))
        self.consumer.assign(offsets)
        logger.info("%s: new lineage from %s: %s", self.source, origin,
                    ", ".join(f"[{p}]@{o}" for (_, p), o in sorted(offsets.items())))
        return Start()

    def _meta(self, published_version: int) -> dict:
        data = self.mix.checkpoint_meta() if self.mix is not None else {}
        return {"group": self.consumer.group_id, "published_version": published_version,
                "model_path": self.model_path, **data}
