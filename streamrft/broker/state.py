"""The state file of a broker started by ``streamrft broker start``, which outlives the command that started it.

Other commands find it through here (``kafka_for``) instead of starting a broker of their own. The file records
the JVMs' pids (one per node) together with the data directory, and a pid only counts as "our broker" while that
process's command line still names that directory, so a recycled pid is never mistaken for the broker, let alone
killed.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .jars import cache_root
from .shutdown import await_exit, left_without_quorum

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BrokerState:
    pid: int
    bootstrap_servers: str
    data_dir: str
    keep_data: bool
    cluster_id: str
    kafka_version: str
    started_at: float
    pids: list[int] = field(default_factory=list)  # every node's JVM; files written before clusters: just ``pid``
    nodes: int = 1

    @property
    def all_pids(self) -> list[int]:
        return self.pids or [self.pid]

    def alive_pids(self) -> list[int]:
        return [pid for pid in self.all_pids if process_alive(pid, self.data_dir)]


def state_path() -> Path:
    return cache_root() / "broker.json"


def read_state() -> BrokerState | None:
    try:
        return BrokerState(**json.loads(state_path().read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        logger.warning("ignoring unreadable broker state file %s (%s)", state_path(), exc)
        return None


def write_state(state: BrokerState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file


def clear_state() -> None:
    state_path().unlink(missing_ok=True)


def process_alive(pid: int, data_dir: str) -> bool:
    """True while ``pid`` is a live (not zombie) process whose command line mentions ``data_dir``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to a bare existence check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return data_dir.encode() in cmdline  # empty for a zombie


def running_broker() -> BrokerState | None:
    """The broker recorded in the state file, if a JVM of it is alive and one of its ports accepts connections
    (a cluster with a node down still serves)."""
    state = read_state()
    if state is None or not state.alive_pids():
        return None
    for address in state.bootstrap_servers.split(","):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return state
        except OSError:
            continue
    return None


def terminate(pids: list[int], data_dir: str, timeout: float = 20.0) -> bool:
    """SIGTERM the broker's process groups (each JVM leads its own; all at once, see EmbeddedBroker.stop), wait
    up to ``timeout`` s (less for nodes left without a controller quorum, see broker/shutdown.py), then SIGKILL
    what is left. Returns False if a node had to be killed that had a quorum to finish its shutdown with."""
    graceful = True
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in pids if process_alive(pid, data_dir)]
        if not alive:
            return graceful
        for pid in alive:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            await_exit([lambda pid=pid: process_alive(pid, data_dir) for pid in alive], 5.0)
            break
        await_exit([lambda pid=pid: process_alive(pid, data_dir) for pid in pids], timeout)
        left = [pid for pid in pids if process_alive(pid, data_dir)]
        if left and not left_without_quorum(len(pids), len(left)):
            logger.warning("broker pids %s did not stop within %.0f s; killing them", left, timeout)
            graceful = False
        elif left:
            logger.info("broker pids %s cannot finish their controlled shutdown without a controller quorum; "
                        "killing them", left)
    return graceful


def user_topic_count(bootstrap_servers: str) -> str:
    """How many non-internal topics the broker at ``bootstrap_servers`` holds, or why that is unknown."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        metadata = AdminClient({"bootstrap.servers": bootstrap_servers}).list_topics(timeout=10)
    except KafkaException as exc:
        return f"unknown ({exc.args[0]})"
    return str(sum(1 for name in metadata.topics if not name.startswith("__")))
