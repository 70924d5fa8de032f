"""The trainer: turns experiences into weight updates. One instance per consumer group (``<run>.trainer``; a
replay / fan-out trainer takes a group of its own with ``--group``).

Each pass of the role loop (``RoleRuntime.run``: ``handle``, then the unit's commit), read as numbered steps:
1. poll ``experiences`` (read_committed) into the group buffer (one GRPO group = one ``group_id``);
2. drop groups still incomplete after ``group_timeout_s``;
3. pick a batch: ``groups_per_train_step`` complete groups, oldest ``step`` first — or a short batch once
   the explorer has finished every step in the buffer and everything it wrote is read (``trainer_batches.py``:
   the batch and end-of-stream rules, of RL and of supervised rows alone);
4. apply the staleness bound (drop or importance-correct), run one optimiser step, note the eids in the audit;
5. when pacing says so (every ``sync.interval`` steps) publish the weights — upload first, then
   ``WEIGHTS_PUBLISHED`` (and, under ``trainer_driven``, a SYNC_REQUEST when one is due);
6. the unit's commit: in ONE transaction the step's metrics (and the signals); then the trained-through offsets,
   so the explorer's lag-based backpressure counts what is still untrained (buffered records stay uncommitted);
7. once that is committed, every ``save_interval`` steps checkpoint: model, optimiser, scheduler, step, the
   consumed offsets and the buffered-but-untrained experiences, written atomically.

Supervised rows (``Experience.objective`` SFT / DPO, from ``streamrft data produce``) train in two ways. With
``trainer.mix`` each RL batch gets its share of them from a second reader of ``experiences``
(``supervised_stream.py`` says why a second one), outside the staleness bound and the advantages. In
``explorer.mode: train`` there is no explorer: this reader takes the supervised rows itself, a batch is
``train_batch_size`` rows of whole groups (a DPO pair is a group of two) in the order read, and the trainer stops
at ``trainer.total_steps`` or, without it, once it has trained everything the topic held when it started.

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
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from functools import partial

import torch

from prometheus_client import Counter, Gauge

from streamrft.config import RunConfig
from streamrft.engines.algorithms import apply_staleness
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines.training.parallel import SingleProcess
from streamrft.engines.training.supervised import pair_problem
from streamrft.engines.training.ranks import RankZeroEngine
from streamrft.errors import ConfigError
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Delivered, Offsets
from streamrft.kafka.dlq import dead_letter
from streamrft.lifecycle import StopSignal
from streamrft.pacing import Pacing
from streamrft.schemas import Experience, Objective, RolloutKind, SingleObjectCodec, SyncKind, SyncSignal
from streamrft.schemas import InvalidRecordError
from streamrft.validation import check_experience
from .checkpoints import Checkpoints
from .group_buffer import Group, GroupBuffer
from .model_paths import resolve_model_path
from .runtime import RoleRuntime
from .supervised_stream import SupervisedStream
from .trainer_batches import BatchPicker
from .unit_of_work import UnitOfWork
from .weight_sync import CollectivePublisher, ObjectStorePublisher

logger = logging.getLogger(__name__)

POLL_S = 0.1
RELEASE_INTERVAL_S = 1.0
PRIMARY = "trainer"  # the group whose weights the run's workers follow
_EPOCH_MS_FROM = 10**12  # a --replay-from integer this large is epoch milliseconds (2001 on), not an offset


# ---------------------------------------------------------------------------------------------------------------
# settings derived from the run config
# ---------------------------------------------------------------------------------------------------------------
def training_settings(config: RunConfig) -> TrainingSettings:
    """The training engine's settings, derived by the run config (checked when it was loaded)."""
    return config.training_settings


def build_engine(config: RunConfig, parallel: SingleProcess | None = None,
                 device: torch.device | str | None = None) -> TrainingEngine:
    """The run's training engine: its model in fp32 on ``device`` (default: ``trainer.device``), spread over
    the ranks by ``parallel`` when given."""
    if device is None and config.trainer.device != "auto":
        device = config.trainer.device
    return TrainingEngine.from_pretrained(resolve_model_path(config.model.path), training_settings(config),
                                          device=device, parallel=parallel, lora=config.model.lora)


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
# the role
# ---------------------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *, group: str | None = None,
                 replay_from: str | ReplayStart | None = None,
                 engine: TrainingEngine | RankZeroEngine | None = None):
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
        self.consumer_group = config.consumer_group(self.source)  # <run>.trainer, <run>.trainer-<name>: one ACL prefix
        self.topic = config.topic("experiences")
        self.replay = parse_replay_from(replay_from) if isinstance(replay_from, str) else replay_from
        ckpt_dir = config.checkpoint_dir
        if not self.primary:  # a fan-out trainer keeps its own lineage next to the main one
            ckpt_dir = ckpt_dir.with_name(f"{ckpt_dir.name}-{self.name}")
        self.checkpoints = Checkpoints(ckpt_dir, self.settings.keep_checkpoints)
        self.pacing = Pacing.of(config)
        self.bound = self.pacing.staleness_bound
        self.codec = SingleObjectCodec()  # checkpointed experiences: registry-independent single-object bytes

        self.engine = engine if engine is not None else build_engine(config)
        self.runtime = RoleRuntime(config, clients, stop, role="trainer", source=self.source,
                                   transactional_id=f"{config.name}.{self.source}")  # fences an older instance
        self.sync = self.runtime.sync
        self.metrics = self.runtime.metrics
        model = self.engine.model
        fits_the_model = {"vocab_size": model.get_input_embeddings().num_embeddings,
                          "max_tokens": getattr(model.config, "max_position_embeddings", None)}
        self.check = partial(check_experience, **fits_the_model)  # also for experiences restored from a checkpoint
        self.consumer = self.runtime.consumer("experiences", self.consumer_group, client_id=self.source,
                                              subscribe=False, check_options=fits_the_model)
        self.mode = config.explorer.mode  # train: supervised rows alone, without an explorer
        self.data: SupervisedStream | None = None  # trainer.mix: the reader of the supervised rows to mix in
        if self.mode != "train" and self.settings.mix.active:
            self.data = SupervisedStream(self.runtime.consumer(
                "experiences", f"{self.consumer_group}.data", client_id=f"{self.source}-data", subscribe=False,
                check_options=fits_the_model, dead_letters=False), self.source)
        self._passed_over = 0  # experiences this trainer does not train (module docstring), counted and logged
        self._mix_metrics: dict[str, float] = {}
        self._released: Offsets = {}  # the offsets _release_passed_over committed last, and when
        self._released_at = 0.0
        self.publisher = None
        if self.primary:
            method = self.settings.weights.method
            self.publisher = (CollectivePublisher(config, self.engine.device, self.source) if method == "collective"
                              else ObjectStorePublisher(config, self.source))
            self.runtime.on_close("weights publisher", self.publisher.close)
        self.buffer = GroupBuffer(config.explorer.repeat_times)
        self.buffer_cap = config.train_batch_size * self.pacing.buffered_steps
        self.step = 0
        self.published_version = -1
        self.checkpointed_step = -1
        self.trained = 0
        self._dropped_incomplete = self._dropped_stale = 0  # since the last step's metrics
        self.batches = BatchPicker(config, self.buffer, self.consumer, clients, self.sync)
        self._prometheus()

    def _prometheus(self) -> None:
        self.registry = self.runtime.registry
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
        self.runtime.serve(self.settings.metrics_port)

    @property
    def endpoint(self):
        return self.runtime.endpoint

    # -- the loop (RoleRuntime.run: poll -> handle -> commit) ----------------------------------------------
    def run(self) -> int:
        self.runtime.run(self)
        return self.step

    def handle(self, unit: UnitOfWork) -> bool:
        if not self._more_to_train():
            return False
        self._read()  # 1.
        self._expire(time.monotonic())  # 2.
        batch = self._next_batch()  # 3.
        if batch is not None:
            self._train(batch, unit)  # 4.-7.
            return self._more_to_train()
        self._release_passed_over(unit)
        return not self._stream_finished()

    def _release_passed_over(self, unit: UnitOfWork) -> None:
        """Between steps, commit how far this reader has read past what it does not train (the supervised rows of
        trainer.mix, often thousands written before the run): the explorer paces on this group's lag, and would
        otherwise wait for a backlog this trainer never takes (at most once a second; it changes no position a
        resume uses, which are the checkpoint's)."""
        now = time.monotonic()
        if now - self._released_at < RELEASE_INTERVAL_S:
            return
        self._released_at = now
        offsets = self._trained_through()
        if offsets != self._released:
            self._released = offsets
            unit.commit_offsets_after(self.consumer, offsets)

    def _more_to_train(self) -> bool:
        total = self.settings.total_steps
        return total is None or self.step < total

    # 1. read ----------------------------------------------------------------------------------------------
    def _read(self) -> None:
        """Take in what is already fetched — up to the explorer's backlog bound, so the oldest step's groups
        are found even when partitions deliver out of step order — and wait briefly only when no batch is
        ready."""
        ready = self.batches.ready()
        if not (ready and len(self.buffer) >= self.buffer_cap):
            for item in self.consumer.poll(max_records=self.buffer_cap, timeout=0 if ready else POLL_S):
                if item.record.kind != RolloutKind.TRAIN or not self._trains_here(item):
                    continue
                if not self.buffer.add(item):
                    logger.warning("%s: duplicate experience %s at %s ignored", self.source, item.record.eid,
                                   item.where)
        self.g_buffered.set(len(self.buffer))

    def _trains_here(self, item: Delivered[Experience]) -> bool:
        """Whether this reader trains the record: RL experiences, or in explorer.mode train supervised ones. The
        supervised rows of trainer.mix are the data reader's; anything else is passed over, counted and logged."""
        supervised = item.record.objective != Objective.RL
        if supervised == (self.mode == "train"):
            return True
        if not (supervised and self.data is not None):
            self._passed_over += 1
            if self._passed_over == 1 or self._passed_over % 1000 == 0:
                why = ("explorer.mode train trains supervised rows only" if self.mode == "train" else
                       "set trainer.mix to mix them into RL batches, or explorer.mode: train to train them alone")
                logger.warning("%s: %d %s experience(s) passed over so far, %s at %s: %s", self.source,
                               self._passed_over, item.record.objective.value, item.record.eid, item.where, why)
        return False

    # 2. incomplete groups -------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        expired = self.buffer.expired(now, self.settings.group_timeout_s)
        if expired:
            self._drop_incomplete(expired, f"still incomplete after {self.settings.group_timeout_s:.0f}s")
        pairs = self.data.expired(now, self.settings.group_timeout_s) if self.data is not None else []
        if pairs:  # already out of the data reader's pools
            self._drop_incomplete(pairs, f"(DPO pairs missing a side) after {self.settings.group_timeout_s:.0f}s")

    def _drop_incomplete(self, groups: list[Group], why: str) -> None:
        count = sum(len(g.items) for g in groups)
        logger.warning("%s: dropping %d incomplete group(s) (%d experiences) %s: %s", self.source, len(groups),
                       count, why, ", ".join(f"{g.group_id} {len(g.items)}/{g.size}" for g in groups[:5]))
        self.buffer.remove(groups)
        self._dropped_incomplete += count
        self.c_dropped.labels("incomplete").inc(count)

    # 3. batch -------------------------------------------------------------------------------------------
    def _next_batch(self) -> list[Group] | None:
        batch = self.batches.next()
        if batch is not None and self.mode != "train" and self.batches.short(batch):
            logger.info("%s: step %d trains a short batch of %d group(s): the explorer finished step %d",
                        self.source, self.step, len(batch), self.sync.explorer.finished_step)
        return batch

    def _stream_finished(self) -> bool:
        """Everything the stream will hold is read, and trained or dropped as incomplete."""
        if not self.batches.everything_read():
            return False
        leftovers = self.buffer.incomplete_groups()
        if leftovers:
            self._drop_incomplete(leftovers, "and no more records will come")
        return not self.buffer.complete_groups()

    # 4.-7. train, publish, commit, checkpoint -------------------------------------------------------------
    def _train(self, groups: list[Group], unit: UnitOfWork) -> None:
        index = self.step
        self.buffer.remove(groups)
        mixed_in = self._mixed_in(groups)  # trainer.mix: supervised groups from the data reader
        supervised = self._pairs_only([g for g in groups + mixed_in if _objective(g) != Objective.RL], unit)
        experiences = [exp for g in groups if _objective(g) == Objective.RL for exp in g.experiences]
        rows = [exp for g in supervised for exp in g.experiences]  # data: no policy version, no staleness bound
        lags = [self.step - e.model_version for e in experiences]
        decision = apply_staleness(experiences, self.step, self.bound, self.settings.staleness_policy)
        self._dropped_stale += decision.dropped
        if decision.dropped:
            self.c_dropped.labels("stale").inc(decision.dropped)
        if not decision.kept and not rows:  # nothing to learn from: release the offsets; counts go with the next step
            logger.warning("%s: all %d experiences of the batch are stale (weights v%d, bound %d); no step",
                           self.source, len(experiences), self.step, self.bound)
            self._commit_offsets(unit)
            return
        started = time.monotonic()
        metrics = self.engine.train_step(decision.kept + rows,  # 4.
                                         needs_correction=decision.needs_correction + [False] * len(rows))
        train_s = time.monotonic() - started
        self.step += 1
        self.trained += len(decision.kept) + len(rows)
        self.c_trained.inc(len(decision.kept) + len(rows))
        kept = {id(e) for e in decision.kept}
        self.checkpoints.record(index, self.step, [e.eid for e in decision.kept + rows],
                                [e.eid for e in experiences if id(e) not in kept],
                                staleness=[index - e.model_version for e in decision.kept] + [0] * len(rows))
        if lags:
            metrics.update({
                "trainer/staleness": sum(lags) / len(lags),
                "trainer/staleness_max": float(max(lags)),
                # experiences whose tokens span versions (rollout.weight_update: in_flight)
                "trainer/spanning_versions": float(sum(e.newest_version != e.model_version for e in experiences)),
            })
        if self.data is not None:
            metrics.update(self._mix_metrics)
        metrics.update({
            "trainer/dropped_stale": float(self._dropped_stale),
            "trainer/dropped_incomplete": float(self._dropped_incomplete),
            "trainer/passed_over": float(self._passed_over),
            "trainer/groups": float(len(groups)),
            "trainer/short_batch": float(self.batches.short(groups)),
            "trainer/buffered": float(len(self.buffer)),
            "time/train_step": train_s,
        })
        self._dropped_stale = self._dropped_incomplete = 0
        if self.publisher is not None and self.pacing.publishes_at(self.step):
            metrics["time/publish_weights"] = self._publish_weights(unit)  # 5.
            delivery = getattr(self.publisher, "last_delivery", None)
            if delivery is not None:  # collective: how many receivers got it by broadcast, in which epoch
                metrics["weights/broadcast_receivers"] = float(len(delivery.receivers))
                metrics["weights/epoch"] = float(delivery.epoch)
                metrics["weights/broadcast_failed"] = float(bool(delivery.failure))
        unit.metrics(index, metrics)  # 6.
        self._commit_offsets(unit)
        unit.describe(f"step {index}")
        self.g_step.set(self.step)
        self.g_step_s.set(train_s)
        unit.after_commit(lambda: logger.info(
            "%s: step %d -> v%d: %d experiences (%d groups, %d stale dropped), %s, %.2fs", self.source, index,
            index + 1, len(decision.kept) + len(rows), len(groups) + len(mixed_in), decision.dropped,
            _losses(metrics), train_s))
        if self.step % self.settings.save_interval == 0:
            unit.after_commit(self._checkpoint)  # 7.

    def _mixed_in(self, groups: list[Group]) -> list[Group]:
        """trainer.mix: the supervised groups that go with this batch's RL rows (their shares of the batch),
        as many as the data reader has or can read now; a dry stream leaves the batch with fewer."""
        if self.data is None:
            return []
        sft, dpo = self.settings.mix.supervised_groups(sum(len(g.items) for g in groups))
        wanted = {objective: count for objective, count in ((Objective.SFT, sft), (Objective.DPO, dpo)) if count}
        self.data.fill(wanted, lambda: self.clients.offsets(self.topic, "end"))
        taken = self.data.take(wanted)
        got = {o: sum(_objective(g) == o for g in taken) for o in (Objective.SFT, Objective.DPO)}
        self._mix_metrics = {
            "mix/sft_rows": float(sum(len(g.items) for g in taken if _objective(g) == Objective.SFT)),
            "mix/sft_missing": float(sft - got[Objective.SFT]),
            "mix/dpo_pairs": float(got[Objective.DPO]),
            "mix/dpo_missing": float(dpo - got[Objective.DPO]),
            "mix/pooled": float(len(self.data)),
        }
        return taken

    def _pairs_only(self, groups: list[Group], unit: UnitOfWork) -> list[Group]:
        """The groups fit to train: a DPO group whose records are not one preference pair (each record passed
        its own check) is dead-lettered whole, with the reason."""
        fit = []
        for group in groups:
            problem = pair_problem(group.experiences) if _objective(group) == Objective.DPO else None
            if problem is None:
                fit.append(group)
                continue
            logger.warning("%s: DPO group %s dead-lettered: %s", self.source, group.group_id, problem)
            self.c_dropped.labels("bad-pair").inc(len(group.items))
            for item in group.items.values():
                unit.dead_letter(dead_letter(
                    topic=item.topic, partition=item.partition, offset=item.offset,
                    key=None if item.key is None else item.key.encode(), value=self.codec.encode(item.record),
                    error=f"DPO group {group.group_id}: {problem}", reason="bad-pair", stage="process",
                    group=self.consumer_group, original_headers=item.headers))
        return fit

    def _commit_offsets(self, unit: UnitOfWork) -> None:
        """After the unit's transaction: each reader's trained-through offsets (the RL reader's pace the explorer)."""
        unit.commit_offsets_after(self.consumer, self._trained_through())
        if self.data is not None:
            offsets = self.data.trained_through()
            unit.after_commit(lambda: self.data.consumer.commit_offsets(offsets))

    def _publish_weights(self, unit: UnitOfWork) -> float:
        """Upload (or broadcast) the weights now; their signals go with the unit. Returns the seconds taken."""
        started = time.monotonic()
        signal = self.publisher.publish(self.engine, self.step)
        self.published_version = self.step
        self.g_published.set(self.step)
        unit.produce(self.config.topic("sync"), signal)
        if self.pacing.sync_request_due(signal.version):
            # trainer_driven: ask the workers to move to this version; the explorer paces on these requests,
            # not on the versions published in between (which bench and eval can still use)
            unit.produce(self.config.topic("sync"), SyncSignal(
                kind=SyncKind.SYNC_REQUEST, version=signal.version, trainer_step=signal.version,
                source=self.source, lineage=signal.lineage))
        return time.monotonic() - started

    def _trained_through(self) -> Offsets:
        """Per partition: the oldest buffered offset, else everything read, up to the consumer's own position:
        past the aborted records and transaction markers behind the last record, which no one ever trains. The
        explorer paces on this group's lag; counted up to them, a broker failover's aborted attempts held it for
        good (a 3-node chaos run stalled on a "lag" of 251 with every experience trained)."""
        offsets = self.consumer.fetch_positions()
        offsets.update(self.buffer.low_water())
        return offsets

    # -- checkpoints --------------------------------------------------------------------------------------
    def _checkpoint(self, with_model: bool = True) -> None:
        if self.step == self.checkpointed_step:
            return  # that step's checkpoint is a consistent snapshot already; later reads are simply re-read
        started = time.monotonic()
        pooled = self.data.items() if self.data is not None else []
        buffered = [{"topic": i.topic, "partition": i.partition, "offset": i.offset, "timestamp_ms": i.timestamp_ms,
                     "value": self.codec.encode(i.record)} for i in self.buffer.items() + pooled]
        meta = {"group": self.consumer_group, "published_version": self.published_version,
                "model_path": self.config.model.path, **self._data_meta()}
        path = self.checkpoints.save(self.step, self.engine.save_state if with_model else None,
                                     self.consumer.positions(), buffered, meta)
        self.checkpointed_step = self.step
        logger.info("%s: checkpoint %s (%d buffered) in %.1fs", self.source, path, len(buffered),
                    time.monotonic() - started)

    def _data_meta(self) -> dict:
        """What a checkpoint says of the data reader (trainer.mix): its positions, beside the RL reader's."""
        if self.data is None:
            return {}
        return {"data_offsets": [[t, p, o] for (t, p), o in sorted(self.data.consumer.positions().items())]}

    def start(self, unit: UnitOfWork) -> None:
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
        self.batches.start()
        if self.publisher is not None:
            announcement = self.publisher.announcement()
            if announcement is not None:
                unit.produce(self.config.topic("sync"), announcement)
                unit.describe("NCCL_READY")
                logger.info("%s: weight-sync membership store at %s; the first broadcast waits for %d "
                            "receiver(s)", self.source, announcement.uri, self.publisher.expected_receivers)
            if self.sync.version > self.step:
                logger.warning("%s: weights v%d on %s are newer than the resumed v%d: that training was lost "
                               "with the process; versions up to v%d are published again from this lineage",
                               self.source, self.sync.version, self.sync.topic, self.step, self.sync.version)
        logger.info("%s: ready after %d steps (group %s, %d buffered, staleness bound %d, checkpoints in %s)",
                    self.source, self.step, self.consumer_group, len(self.buffer), self.bound, self.checkpoints.root)

    def _resume(self, path: Path, partitions: Offsets) -> Offsets:
        checkpoint = self.checkpoints.load(path)
        if checkpoint.has_model:
            self.engine.load_state(path)
        self.step = self.checkpointed_step = checkpoint.step
        self.published_version = int(checkpoint.meta.get("published_version", -1))
        now = time.monotonic()
        for entry in checkpoint.buffered:
            record = self.codec.decode(entry["value"], Experience)
            try:
                self.check(record)  # a checkpoint written before a check existed may hold a bad one
            except InvalidRecordError as exc:
                logger.warning("%s: buffered experience %s from the checkpoint skipped: %s", self.source,
                               record.eid, exc)
                continue
            item = Delivered(record, entry["topic"], int(entry["partition"]), int(entry["offset"]), record.group_id,
                             int(entry.get("timestamp_ms", 0)))
            if self.data is not None and record.objective != Objective.RL:
                self.data.add(item, now)
            elif self._trains_here(item):  # a checkpoint of another mode may hold what this one passes over
                self.buffer.add(item, now)
        removed = self.checkpoints.truncate_audit(checkpoint.step)
        offsets = {tp: checkpoint.offsets.get(tp, low) for tp, low in partitions.items()}
        if self.data is not None:
            saved = {(t, int(p)): int(o) for t, p, o in checkpoint.meta.get("data_offsets", [])}
            self._assign_data(partitions, saved or None)
        self.g_step.set(self.step)
        logger.info("%s: resuming from %s: %d steps done (weights v%d), %d buffered experience(s), %d audit "
                    "entr%s of lost steps removed", self.source, path, self.step, self.step, len(checkpoint.buffered),
                    removed, "y" if removed == 1 else "ies")
        return offsets

    def _origin(self, partitions: Offsets) -> Offsets:
        if self.replay is not None and self.replay.offset is not None:
            ends = self.clients.offsets(self.topic, "end")
            offsets = {tp: min(max(self.replay.offset, low), ends[tp]) for tp, low in partitions.items()}
            origin = f"replay from {self.replay}"
        elif self.replay is not None:
            offsets = self.clients.offsets_for_time(self.topic, self.replay.timestamp_ms)
            origin = f"replay from {self.replay}"
        else:
            committed = self.clients.committed(self.consumer_group, self.topic)
            offsets = {tp: max(committed.get(tp, low), low) for tp, low in partitions.items()}
            origin = "the group's committed offsets" if committed else "the beginning"
        self.checkpoints.truncate_audit(0)
        if self.data is not None:
            self._assign_data(partitions, offsets if self.replay is not None else None)
        self._checkpoint_origin(offsets)
        logger.info("%s: new lineage from %s: %s", self.source, origin,
                    ", ".join(f"[{p}]@{o}" for (_, p), o in sorted(offsets.items())))
        return offsets

    def _assign_data(self, partitions: Offsets, offsets: Offsets | None) -> None:
        """Start the data reader at ``offsets``, or where its group committed, or the beginning (a checkpoint
        written before trainer.mix was set has none of its own)."""
        if offsets is None:
            committed = self.clients.committed(self.data.consumer.group_id, self.topic)
            offsets = {tp: max(committed.get(tp, low), low) for tp, low in partitions.items()}
        self.data.consumer.assign({tp: offsets.get(tp, low) for tp, low in partitions.items()})

    def _checkpoint_origin(self, offsets: Offsets) -> None:
        """Step 0: the starting offsets and the base model (no weights written)."""
        meta = {"group": self.consumer_group, "published_version": -1, "model_path": self.config.model.path,
                "origin": True, **self._data_meta()}
        self.checkpoints.save(0, None, offsets, [], meta)
        self.checkpointed_step = 0

    # -- the end ------------------------------------------------------------------------------------------
    def finish(self, unit: UnitOfWork) -> None:
        if self.stop.requested:
            logger.info("%s: stop requested after %d steps; checkpointing", self.source, self.step)
        elif self.publisher is not None and self.step > max(self.published_version, 0):
            seconds = self._publish_weights(unit)
            unit.describe(f"publishing v{self.step}")
            logger.info("%s: final weights v%d published in %.1fs", self.source, self.step, seconds)
        unit.after_commit(self._checkpoint)
        unit.after_commit(lambda: logger.info("%s: stopped after %d steps (%d experiences trained, %d buffered)",
                                              self.source, self.step, self.trained, len(self.buffer)))

    def close(self) -> None:
        self.runtime.close()


def _objective(group: Group) -> Objective:
    """A group's objective (its records share one: a group is one task's samples, a conversation or a pair)."""
    return next(iter(group.items.values())).record.objective


def _losses(metrics: dict[str, float]) -> str:
    """The step's losses for its log line: RL's (with the reward), SFT's, DPO's, whichever it trained."""
    parts = []
    if "actor/loss" in metrics:
        parts.append(f"reward {metrics['actor/reward_mean']:.3f}, loss {metrics['actor/loss']:.4f}")
    if "sft/loss" in metrics:
        parts.append(f"sft loss {metrics['sft/loss']:.4f}")
    if "dpo/loss" in metrics:
        parts.append(f"dpo loss {metrics['dpo/loss']:.4f} (accuracy {metrics['dpo/accuracy']:.2f})")
    return ", ".join(parts)
