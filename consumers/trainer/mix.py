"""``trainer.mix``: the supervised groups that go with each RL batch, their shares of the batch's rows, from the
trainer's second reader of ``experiences`` (``supervised_stream.py`` says why a second one); where that reader
starts, and what a checkpoint and a commit say of it."""
from __future__ import annotations

from streamrft.config import RunConfig
from streamrft.kafka import KafkaClients
from streamrft.kafka.consumer import Delivered, Offsets
from streamrft.runtime import RoleRuntime, UnitOfWork
from streamrft.schemas import Experience, Objective

from .group_buffer import Group
from .supervised_stream import SupervisedStream


class SupervisedMix:
    def __init__(self, config: RunConfig, runtime: RoleRuntime, clients: KafkaClients, consumer_group: str,
                 source: str, check_options: dict):
        self.settings = config.trainer.mix
        self.clients = clients
        self.topic = config.topic("experiences")
        self.stream = SupervisedStream(runtime.consumer(
            "experiences", f"{consumer_group}.data", client_id=f"{source}-data", subscribe=False,
            check_options=check_options, dead_letters=False), source)
        self.consumer = self.stream.consumer
        self.metrics: dict[str, float] = {}  # of the last batch

    def for_batch(self, groups: list[Group]) -> list[Group]:
        """The supervised groups that go with this batch's RL groups, as many as the reader has or can read now; a
        dry stream leaves the batch with fewer."""
        sft, dpo = self.settings.supervised_groups(sum(len(g.items) for g in groups))
        wanted = {objective: count for objective, count in ((Objective.SFT, sft), (Objective.DPO, dpo)) if count}
        self.stream.fill(wanted, lambda: self.clients.offsets(self.topic, "end"))
        taken = self.stream.take(wanted)
        got = {o: sum(g.objective == o for g in taken) for o in (Objective.SFT, Objective.DPO)}
        self.metrics = {
            "mix/sft_rows": float(sum(len(g.items) for g in taken if g.objective == Objective.SFT)),
            "mix/sft_missing": float(sft - got[Objective.SFT]),
            "mix/dpo_pairs": float(got[Objective.DPO]),
            "mix/dpo_missing": float(dpo - got[Objective.DPO]),
            "mix/pooled": float(len(self.stream)),
        }
        return taken

    def expired(self, now: float, timeout_s: float) -> list[Group]:
        """DPO pairs still missing a side after ``timeout_s``, out of the pools."""
        return self.stream.expired(now, timeout_s)

    def add(self, item: Delivered[Experience], now: float) -> None:
        """A supervised experience restored from a checkpoint."""
        self.stream.add(item, now)

    def clear(self) -> None:
        """Empty the pools (a checkpoint hands back what they held)."""
        for pool in self.stream.pools.values():
            pool.clear()

    def items(self) -> list[Delivered[Experience]]:
        """The pooled experiences, for a checkpoint."""
        return self.stream.items()

    # -- positions -------------------------------------------------------------------------------------------
    def assign(self, partitions: Offsets, offsets: Offsets | None) -> None:
        """Start the reader at ``offsets``, or where its group committed, or the beginning (a checkpoint written
        before trainer.mix was set has none of its own)."""
        if offsets is None:
            committed = self.clients.committed(self.consumer.group_id, self.topic)
            offsets = {tp: max(committed.get(tp, low), low) for tp, low in partitions.items()}
        self.consumer.assign({tp: offsets.get(tp, low) for tp, low in partitions.items()})

    def checkpoint_meta(self) -> dict:
        """What a checkpoint says of the reader: its positions, beside the RL reader's."""
        return {"data_offsets": [[t, p, o] for (t, p), o in sorted(self.consumer.positions().items())]}

    @staticmethod
    def saved_offsets(meta: dict) -> Offsets | None:
        """The reader's positions in a checkpoint's meta (None: the checkpoint has none)."""
        return {(t, int(p)): int(o) for t, p, o in meta.get("data_offsets", [])} or None

    def commit_offsets(self, unit: UnitOfWork) -> None:
        """After the unit's transaction: the offsets the reader has trained through."""
        offsets = self.stream.trained_through()
        unit.after_commit(lambda: self.consumer.commit_offsets(offsets))
