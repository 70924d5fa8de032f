"""Which rollout requests of each partition are done, so that a worker finishing them out of order commits each
one as soon as it is done, and whoever reads the partition next redoes none of them.

A partition's commit point is the offset of its lowest unfinished request, or the next offset to read when none
is unfinished. The metadata committed with it (Kafka keeps a string beside each committed offset, in the same
transaction) lists the offsets above the point that are done already, as distances from it: ``done:1,2,5``.
The next reader of the partition -- this worker after a rebalance, another one, a restart -- starts at the
committed offset and skips what the metadata lists. A request is committed whole (its experiences, result and
place in the ledger in one transaction) or not at all, and exactly once.

The metadata must stay under the broker's ``offset.metadata.max.bytes`` (4096 by default): a partition with
``MAX_DONE_AHEAD`` requests done above its lowest unfinished one takes no new requests until that one is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from streamrft.kafka.consumer import CommitPoints, Offsets

PREFIX = "done:"
MAX_DONE_AHEAD = 256  # ~1.5 KB of metadata at most

Partition = tuple[str, int]


def encode_done(base: int, done: set[int]) -> str:
    return PREFIX + ",".join(str(offset - base) for offset in sorted(done) if offset > base)


def decode_done(base: int, metadata: str) -> set[int]:
    """The done offsets a commit's metadata lists; metadata that is not ours (another tool's commit) lists none."""
    if base < 0 or not metadata.startswith(PREFIX):
        return set()
    return {base + int(distance) for distance in metadata[len(PREFIX):].split(",") if distance.isdigit()}


@dataclass
class _PartitionState:
    next_offset: int  # the next offset to read: everything below it was handed out
    open: set[int] = field(default_factory=set)  # admitted, not finished
    done: set[int] = field(default_factory=set)  # finished (or done before, per the committed metadata)

    def point(self) -> int:
        return min(self.open) if self.open else self.next_offset


class RequestLedger:
    def __init__(self) -> None:
        self._partitions: dict[Partition, _PartitionState] = {}

    def knows(self, partition: Partition) -> bool:
        return partition in self._partitions

    def load(self, partition: Partition, committed_offset: int, metadata: str) -> None:
        """Start following ``partition`` from its committed point (offset -1: nothing committed yet)."""
        self._partitions[partition] = _PartitionState(max(committed_offset, 0),
                                                      done=decode_done(committed_offset, metadata))

    def admit(self, partition: Partition, offset: int) -> bool:
        """Note a read request; False when it is running already or done (its outcome committed before): a
        partition revoked and given back in one poll can hand out the same offset twice."""
        state = self._partitions[partition]
        state.next_offset = max(state.next_offset, offset + 1)
        if offset in state.done or offset in state.open:
            return False
        state.open.add(offset)
        return True

    def saw(self, positions: Offsets) -> None:
        """Everything below these next offsets was handed out (records dead-lettered at the edge included)."""
        for partition, offset in positions.items():
            if partition in self._partitions:
                state = self._partitions[partition]
                state.next_offset = max(state.next_offset, offset)

    def finish(self, partition: Partition, offset: int) -> None:
        state = self._partitions[partition]
        state.open.discard(offset)
        state.done.add(offset)

    def full(self, partition: Partition) -> bool:
        """Too many requests done above the lowest unfinished one to list them in a commit's metadata."""
        state = self._partitions.get(partition)
        return state is not None and len(state.done) >= MAX_DONE_AHEAD

    def commit_points(self) -> CommitPoints:
        """What to commit for every followed partition: the lowest unfinished offset, and the done ones above."""
        points = {}
        for partition, state in self._partitions.items():
            base = state.point()
            points[partition] = (base, encode_done(base, {o for o in state.done if o > base}))
        return points

    def committed(self, points: CommitPoints) -> None:
        """``points`` are committed: forget the done offsets below them."""
        for partition, (base, _) in points.items():
            state = self._partitions.get(partition)
            if state is not None:
                state.done = {o for o in state.done if o > base}

    def forget(self, partitions: set[Partition]) -> None:
        """Stop following these partitions (revoked: their next reader starts from the committed point)."""
        for partition in partitions:
            self._partitions.pop(partition, None)
