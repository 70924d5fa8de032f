"""Where things are on the embedded cluster, for the code that breaks it on purpose (bench/chaos.py, the cluster
tests) and for waiting until it has healed: the KRaft quorum's leader, a partition's leader, the transaction
coordinator of a transactional id, and the partitions whose replicas are not all in sync."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from confluent_kafka.admin import AdminClient

logger = logging.getLogger(__name__)

TRANSACTION_STATE = "__transaction_state"
QUORUM_STATE = Path("__cluster_metadata-0") / "quorum-state"  # under a node's log.dirs


def quorum_leader(storages: list[Path]) -> int | None:
    """The node id of the active controller, from the nodes' own ``quorum-state`` files (the KRaft election
    state each voter writes when it changes): the leader of the newest epoch any node knows. Kafka's metadata
    cannot tell: in KRaft a broker names a random broker as "controller" to clients. None while no node knows one.
    """
    best: tuple[int, int] | None = None  # (epoch, leader)
    for storage in storages:
        try:
            state = json.loads((storage / QUORUM_STATE).read_text())
        except (OSError, ValueError):
            continue  # not formatted yet, being rewritten, or wiped
        epoch, leader = state.get("leaderEpoch", -1), state.get("leaderId", -1)
        if leader >= 0 and (best is None or epoch > best[0]):
            best = (epoch, leader)
    return best[1] if best else None


def leader_of(admin: AdminClient, topic: str, partition: int, timeout: float = 10.0) -> int:
    """The broker that leads ``topic[partition]`` (-1: none right now)."""
    metadata = admin.list_topics(topic, timeout=timeout).topics.get(topic)
    if metadata is None or metadata.error is not None or partition not in metadata.partitions:
        raise KeyError(f"{topic}[{partition}] is not in the cluster's metadata")
    return metadata.partitions[partition].leader


def java_hash(text: str) -> int:
    """Java's ``String.hashCode`` (over UTF-16 code units, 32-bit overflow), which Kafka places ids by."""
    h = 0
    units = text.encode("utf-16-be")
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def transaction_coordinator(admin: AdminClient, transactional_id: str, timeout: float = 10.0) -> int:
    """The broker coordinating ``transactional_id``'s transactions: the leader of its ``__transaction_state``
    partition, ``abs(hashCode) % partitions`` as Kafka's TransactionStateManager.partitionFor places it."""
    metadata = admin.list_topics(TRANSACTION_STATE, timeout=timeout).topics.get(TRANSACTION_STATE)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise KeyError(f"{TRANSACTION_STATE} does not exist yet (no transaction was started on this cluster)")
    partition = (java_hash(transactional_id) & 0x7FFFFFFF) % len(metadata.partitions)
    return metadata.partitions[partition].leader


def not_in_sync(admin: AdminClient, brokers: int, timeout: float = 10.0) -> list[str]:
    """What keeps the cluster from being whole, one line each: brokers missing from the metadata, and partitions
    (internal topics included) without a leader or with a replica out of the ISR. Empty when whole."""
    metadata = admin.list_topics(timeout=timeout)
    problems = []
    if len(metadata.brokers) < brokers:
        problems.append(f"brokers {sorted(metadata.brokers)} registered of {brokers}")
    for name, topic in sorted(metadata.topics.items()):
        if topic.error is not None:
            problems.append(f"{name}: {topic.error.str()}")
            continue
        for p in topic.partitions.values():
            if p.leader < 0 or set(p.isrs) != set(p.replicas):
                problems.append(f"{name}[{p.id}] leader {p.leader}, in sync {sorted(p.isrs)} of {sorted(p.replicas)}")
    return problems
