"""Weight signals the worker refused for good, as dead letters on ``sync.dlq``: once for the whole consumer group,
however many workers refuse them (transient refusals are retried, never letters). Each letter goes with the
worker's next transaction, and with the one after when that one could not commit."""
from __future__ import annotations

from collections.abc import Iterable

from streamrft.kafka import KafkaClients, dead_letter
from streamrft.runtime import UnitOfWork
from streamrft.sync import SyncView


class RefusalLetters:
    def __init__(self, clients: KafkaClients, sync: SyncView, group: str) -> None:
        self.clients = clients
        self.sync = sync
        self.group = group
        self._sent = clients.dead_letter_ledger(group, sync.topic)  # what the group dead-lettered already
        self._pending: list = []
        self._staged: list = []  # the letters in the unit being committed

    def note(self, refusals: Iterable) -> None:
        """The follower's refusals (``WeightFollower.take_refusals``): a letter for each final one not sent yet."""
        for refusal in refusals:
            partition, offset = self.sync.where.get(refusal.signal.kind, (0, -1))
            where = (self.sync.topic, partition, offset)
            if refusal.transient or where in self._sent:
                continue
            self._sent.add(where)
            self._pending.append(dead_letter(
                topic=self.sync.topic, partition=partition, offset=offset, key=refusal.signal.key.encode(),
                value=self.clients.serde.encode(refusal.signal, self.sync.topic), error=refusal.detail,
                reason=refusal.reason, stage="weights", group=self.group))

    def stage(self, unit: UnitOfWork) -> bool:
        """Stage every pending letter on ``unit``; True if there was any."""
        self._staged, self._pending = self._pending, []
        for letter in self._staged:
            unit.dead_letter(letter)
        return bool(self._staged)

    def discarded(self) -> None:
        """The unit they were staged on was discarded: the next unit sends them."""
        self._pending[:0] = self._staged
        self._staged = []
