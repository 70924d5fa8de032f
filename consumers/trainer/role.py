"""The trainer: turns experiences into weight updates. One instance per consumer group (``<run>.trainer``; a
replay / fan-out trainer takes a group of its own with ``--group``).

Each pass of the role loop (``RoleRuntime.run``: ``handle``, then the unit's commit), read as numbered steps:
1. poll ``experiences`` (read_committed) into the group buffer (one GRPO group = one ``group_id``);
2. drop groups still incomplete after ``group_timeout_s``;
3. pick a batch: ``groups_per_train_step`` complete groups, oldest ``step`` first — or a short batch once
   the explorer has finished every step in the buffer and everything it wrote is read (``batches.py``: the batch
   and end-of-stream rules, of RL and of supervised rows alone);
4. apply the staleness bound (drop or importance-correct), run one optimiser step, note the eids in the audit;
5. when pacing says so (every ``sync.interval`` steps) publish the weights (``publishing.py``) — upload first,
   then ``WEIGHTS_PUBLISHED`` (and, under ``trainer_driven``, a SYNC_REQUEST when one is due);
6. the unit's commit: in ONE transaction the step's metrics (and the signals); then the trained-through offsets,
   so the explorer's lag-based backpressure counts what is still untrained (buffered records stay uncommitted),
   once the group is found to hold what the trainer committed last (``commits.py``, ``group_offsets.py``: a reset
   by someone else stops the trainer, or with ``--accept-offset-reset`` moves its reader there);
7. once that is committed, every ``save_interval`` steps checkpoint (``lineage.py``): model, optimiser,
   scheduler, step, the consumed offsets and the buffered-but-untrained experiences, written atomically.

What the trainer reads is the run's shape (``streamrft/run_shape.py``). RL experiences, and with ``trainer.mix``
each RL batch also gets its share of supervised rows (``Experience.objective`` SFT / DPO, from ``streamrft data
produce``) from a second reader (``mix.py``), outside the staleness bound and the advantages. In ``mode: train``
there is no explorer: this reader takes the supervised rows itself, a batch is ``train_batch_size`` rows of whole
groups (a DPO pair is a group of two) in the order read, and the trainer stops at ``trainer.total_steps`` or,
without it, once it has trained everything the topic held when it started.

Numbering: trainer step ``t`` (0-based: the ``step`` of its metrics and audit line) produces weights version
``t + 1`` — versions count the steps trained into the weights — and, under ``fixed`` pacing, trains explorer
step ``t``'s experiences, so the monitor's rows line up. Checkpoint ``step-N`` (and the audit's ``version``)
holds N steps.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

from streamrft.config import RunConfig
from streamrft.config.object_store import is_s3_url
from streamrft.engines.algorithms import apply_staleness
from streamrft.engines.training import TrainingEngine
from streamrft.engines.training.ranks import RankZeroEngine
from streamrft.errors import ConfigError
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Delivered
from streamrft.lifecycle import StopSignal
from streamrft.pacing import Pacing
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.schemas import Experience, Objective, RolloutKind
from streamrft.validation import check_experience

from .batches import BatchPicker
from .checkpoints import Checkpoints
from .commits import TrainedOffsets
from .remote_checkpoints import RemoteCheckpoints
from .engine import build_engine
from .group_buffer import Group, GroupBuffer
from .lineage import Lineage, Start
from .metrics import TrainerMetrics
from .mix import SupervisedMix
from .pairs import PairCheck
from .publishing import WeightsPublishing
from .replay import ReplayStart, parse_replay_from

logger = logging.getLogger(__name__)

POLL_S = 0.1
PRIMARY = "trainer"  # the group whose weights the run's workers follow
OTHER_ROLES = ("explorer", "rollout", "monitor", "sync-view")


class Trainer:
    def __init__(self, config: RunConfig, clients: KafkaClients, stop: StopSignal, *, group: str | None = None,
                 replay_from: str | ReplayStart | None = None, accept_offset_reset: bool = False,
                 engine: TrainingEngine | RankZeroEngine | None = None):
        self.settings = config.trainer
        self.shape = config.shape
        self.stop = stop
        name = group or PRIMARY
        if not name.replace("-", "").replace("_", "").isalnum() or name in OTHER_ROLES:
            raise ConfigError(f"--group {name!r}: use letters, digits, '-' and '_', and not another role's name")
        replay = parse_replay_from(replay_from) if isinstance(replay_from, str) else replay_from
        primary = name == PRIMARY
        self.source = PRIMARY if primary else f"{PRIMARY}-{name}"
        self.consumer_group = config.consumer_group(self.source)  # <run>.trainer, <run>.trainer-<name>: one ACL prefix
        pacing = Pacing.of(config)
        self.bound = pacing.staleness_bound
        self.engine = engine if engine is not None else build_engine(config)
        self.runtime = RoleRuntime(config, clients, stop, role="trainer", source=self.source,
                                   transactional_id=f"{config.name}.{self.source}")  # fences an older instance
        self.sync = self.runtime.sync
        self.metrics = TrainerMetrics(self.runtime, self.settings.metrics_port)
        model = self.engine.model
        fits_the_model = {"vocab_size": model.get_input_embeddings().num_embeddings,
                          "max_tokens": getattr(model.config, "max_position_embeddings", None)}
        self.consumer = self.runtime.consumer("experiences", self.consumer_group, client_id=self.source,
                                              subscribe=False, check_options=fits_the_model)
        self.mix = (SupervisedMix(config, self.runtime, clients, self.consumer_group, self.source, fits_the_model)
                    if self.shape.trainer_mixes_supervised else None)
        self.publishing = WeightsPublishing(config, self.runtime, self.engine, self.source, primary=primary)
        self.buffer = GroupBuffer(config.explorer.repeat_times)
        self.commits = TrainedOffsets(self.consumer, self.buffer, self.mix, source=self.source,
                                      accept_reset=accept_offset_reset,
                                      checkpoint_step=lambda: self.lineage.checkpointed_step)
        self.lineage = Lineage(
            _checkpoints(config, name, primary), clients,
            self.consumer, source=self.source, model_path=config.model.path, replay=replay, mix=self.mix,
            check=partial(check_experience, **fits_the_model), group_offsets=self.commits.group)
        self.pairs = PairCheck(self.consumer_group, self.source, self.metrics)
        self.buffer_cap = config.train_batch_size * pacing.buffered_steps
        self.batches = BatchPicker(config, self.buffer, self.consumer, clients, self.sync)
        self.step = 0
        self.trained = 0

    @property
    def endpoint(self):
        return self.runtime.endpoint

    @property
    def published_version(self) -> int:
        return self.publishing.published_version

    # -- the loop (RoleRuntime.run: poll -> handle -> commit) ----------------------------------------------
    def run(self) -> int:
        self.runtime.run(self)
        return self.step

    def start(self, unit: UnitOfWork) -> None:
        """Catch up on ``sync``; go on from the lineage's newest checkpoint or begin one (``lineage.py``)."""
        self.sync.catch_up()
        self._take_over(self.lineage.start())
        if self.commits.group.carries_accepted:  # the group's offsets become the trainer's, marked as accepted
            self.commits.after_step(unit, self.step)
        self.batches.start()
        self.publishing.announce(unit, self.sync, self.step)
        logger.info("%s: ready after %d steps (group %s, %d buffered, staleness bound %d, checkpoints in %s)",
                    self.source, self.step, self.consumer_group, len(self.buffer), self.bound,
                    self.lineage.checkpoints.root)

    def rejoin(self, unit: UnitOfWork) -> None:
        """A unit could not commit (the brokers were away past its deadline): its step's metrics and weights
        signal are not visible, and the engine is ahead of what is committed. The trainer goes back to its newest
        checkpoint, as a restart would: engine state, offsets and buffer; the steps after it are trained again
        under the same numbers (the audit keeps the surviving lineage's)."""
        unit.discard()
        start = self.lineage.reload()
        if start.engine_state is None and start.step != self.step:
            raise RuntimeError(f"{self.source}: the newest checkpoint (step {start.step}) holds no weights to go "
                               f"back to from step {self.step}; restart the trainer (it begins from the base model)")
        self.buffer.clear()  # the checkpoint hands back what it held
        if self.mix is not None:
            self.mix.clear()
        self.commits.forget_released()
        self._take_over(start)
        logger.info("%s: back to the checkpoint of step %d (%d buffered)", self.source, self.step, len(self.buffer))

    def _take_over(self, start: Start) -> None:
        """The engine, step, published version and buffer of where the lineage goes on (``lineage.py``)."""
        if start.engine_state is not None:
            self.engine.load_state(start.engine_state)
        self.step = start.step
        self.publishing.published_version = start.published_version
        now = time.monotonic()
        for item in start.buffered:
            if self.mix is not None and item.record.objective != Objective.RL:
                self.mix.add(item, now)
            elif self._trains_here(item):  # a checkpoint of another shape may hold what this one passes over
                self.buffer.add(item, now)
        self.metrics.step.set(self.step)

    def handle(self, unit: UnitOfWork) -> bool:
        if not self._more_to_train():
            return False
        self._read()  # 1.
        self._expire(time.monotonic())  # 2.
        batch = self._next_batch()  # 3.
        if batch is not None:
            self._train(batch, unit)  # 4.-7.
            return self._more_to_train()
        self.commits.release(unit, self.step)
        return not self._stream_finished()

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
        self.metrics.buffered.set(len(self.buffer))

    def _trains_here(self, item: Delivered[Experience]) -> bool:
        """Whether this reader trains the record: RL experiences, or supervised ones when the trainer reads those
        alone. The supervised rows of trainer.mix are its own reader's; anything else is passed over, counted
        and logged."""
        supervised = item.record.objective != Objective.RL
        if supervised == self.shape.trainer_reads_supervised_only:
            return True
        if not (supervised and self.mix is not None):
            passed = self.metrics.pass_over()
            if passed == 1 or passed % 1000 == 0:
                why = ("mode train trains supervised rows only" if self.shape.trainer_reads_supervised_only else
                       "set trainer.mix to mix them into RL batches, or mode: train to train them alone")
                logger.warning("%s: %d %s experience(s) passed over so far, %s at %s: %s", self.source, passed,
                               item.record.objective.value, item.record.eid, item.where, why)
        return False

    # 2. incomplete groups -------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        timeout = self.settings.group_timeout_s
        expired = self.buffer.expired(now, timeout)
        if expired:
            self._drop_incomplete(expired, f"still incomplete after {timeout:.0f}s")
        pairs = self.mix.expired(now, timeout) if self.mix is not None else []
        if pairs:  # already out of the mix's pools
            self._drop_incomplete(pairs, f"(DPO pairs missing a side) after {timeout:.0f}s")

    def _drop_incomplete(self, groups: list[Group], why: str) -> None:
        count = sum(len(g.items) for g in groups)
        logger.warning("%s: dropping %d incomplete group(s) (%d experiences) %s: %s", self.source, len(groups),
                       count, why, ", ".join(f"{g.group_id} {len(g.items)}/{g.size}" for g in groups[:5]))
        self.buffer.remove(groups)
        self.metrics.drop("incomplete", count)

    # 3. batch -------------------------------------------------------------------------------------------
    def _next_batch(self) -> list[Group] | None:
        batch = self.batches.next()
        if batch is not None and not self.shape.trainer_reads_supervised_only and self.batches.short(batch):
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
        mixed_in = self.mix.for_batch(groups) if self.mix is not None else []
        supervised = self.pairs.fit([g for g in groups + mixed_in if g.objective != Objective.RL], unit)
        experiences = [exp for g in groups if g.objective == Objective.RL for exp in g.experiences]
        rows = [exp for g in supervised for exp in g.experiences]  # data: no policy version, no staleness bound
        decision = apply_staleness(experiences, index, self.bound, self.settings.staleness_policy)
        if decision.dropped:
            self.metrics.drop("stale", decision.dropped)
        if not decision.kept and not rows:  # nothing to learn from: release the offsets; counts go with the next step
            logger.warning("%s: all %d experiences of the batch are stale (weights v%d, bound %d); no step",
                           self.source, len(experiences), index, self.bound)
            self.commits.after_step(unit, self.step)
            return
        started = time.monotonic()
        metrics = self.engine.train_step(decision.kept + rows,  # 4.
                                         needs_correction=decision.needs_correction + [False] * len(rows))
        train_s = time.monotonic() - started
        self.step += 1
        self.trained += len(decision.kept) + len(rows)
        self.metrics.stepped(self.step, train_s, len(decision.kept) + len(rows))
        kept = {id(e) for e in decision.kept}
        self.lineage.checkpoints.record(index, self.step, [e.eid for e in decision.kept + rows],
                                        [e.eid for e in experiences if id(e) not in kept],
                                        staleness=[index - e.model_version for e in decision.kept] + [0] * len(rows))
        metrics.update(self._batch_metrics(index, experiences, groups, train_s))
        if self.publishing.due(self.step):
            metrics.update(self.publishing.publish(self.step, unit))  # 5.
            self.metrics.published.set(self.step)
        unit.metrics(index, metrics)  # 6.
        self.commits.after_step(unit, self.step)
        unit.describe(f"step {index}")
        unit.after_commit(lambda: logger.info(
            "%s: step %d -> v%d: %d experiences (%d groups, %d stale dropped), %s, %.2fs", self.source, index,
            index + 1, len(decision.kept) + len(rows), len(groups) + len(mixed_in), decision.dropped,
            _losses(metrics), train_s))
        if self.step % self.settings.save_interval == 0:
            unit.after_commit(self._checkpoint)  # 7.

    def _batch_metrics(self, index: int, experiences: list[Experience], groups: list[Group],
                       train_s: float) -> dict[str, float]:
        """The step's metrics beside the engine's: staleness, the mix, what was not trained, the batch."""
        metrics = {}
        lags = [index - e.model_version for e in experiences]
        if lags:
            metrics.update({
                "trainer/staleness": sum(lags) / len(lags),
                "trainer/staleness_max": float(max(lags)),
                # experiences whose tokens span versions (rollout.weight_update: in_flight)
                "trainer/spanning_versions": float(sum(e.newest_version != e.model_version for e in experiences)),
            })
        if self.mix is not None:
            metrics.update(self.mix.metrics)
        metrics.update(self.metrics.counts())
        metrics.update({
            "trainer/groups": float(len(groups)),
            "trainer/short_batch": float(self.batches.short(groups)),
            "trainer/buffered": float(len(self.buffer)),
            "time/train_step": train_s,
        })
        return metrics

    def _checkpoint(self) -> None:
        pooled = self.mix.items() if self.mix is not None else []
        self.lineage.save(self.step, self.engine.save_state, self.buffer.items() + pooled,
                          self.publishing.published_version)

    # -- the end ------------------------------------------------------------------------------------------
    def finish(self, unit: UnitOfWork) -> None:
        if self.stop.requested:
            logger.info("%s: stop requested after %d steps; checkpointing", self.source, self.step)
        elif self.publishing.final_due(self.step):
            seconds = self.publishing.publish(self.step, unit)["time/publish_weights"]
            self.metrics.published.set(self.step)
            unit.describe(f"publishing v{self.step}")
            logger.info("%s: final weights v%d published in %.1fs", self.source, self.step, seconds)
        unit.after_commit(self._checkpoint)
        unit.after_commit(lambda: logger.info("%s: stopped after %d steps (%d experiences trained, %d buffered)",
                                              self.source, self.step, self.trained, len(self.buffer)))

    def close(self) -> None:
        self.runtime.close()


def _checkpoint_dir(config: RunConfig, name: str, primary: bool) -> Path:
    """The lineage's directory: a fan-out or replay trainer keeps its own next to the main one."""
    root = config.checkpoint_dir
    return root if primary else root.with_name(f"{root.name}-{name}")


def _checkpoints(config: RunConfig, name: str, primary: bool) -> Checkpoints:
    """The lineage's checkpoints: in a local directory, or on an object store (``checkpoint_dir: s3://...``,
    reached with ``trainer.weights.s3``) with the same guarantees."""
    keep = config.trainer.keep_checkpoints
    if not is_s3_url(config.checkpoint_url):
        return Checkpoints(_checkpoint_dir(config, name, primary), keep)
    url = config.checkpoint_url.rstrip("/")
    return RemoteCheckpoints(url if primary else f"{url}-{name}", keep, config.trainer.weights.s3.storage_options())


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
