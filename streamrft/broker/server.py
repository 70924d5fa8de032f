"""The embedded broker: one KRaft node, or ``broker.nodes`` of them as a replicated cluster, on loopback, for
local runs and tests. Each node is its own JVM (node.py) with its own data dir and ports, and is broker and
controller at once; in a cluster every node is a voter of the KRaft quorum, and topics (the internal ones too)
get replication factor min(3, nodes) and min.insync.replicas 2.

Start-up, in order: pick free ports (two per node) → write each node's server.properties → format the storage
(once per data dir, one cluster id for all nodes) → launch the JVMs → wait until every node accepts connections,
the cluster answers metadata with *our* cluster id (a port picked as free can be taken by someone else's broker
meanwhile) and lists every node as a broker, a transactional producer id is handed out and a consumer group
finds its coordinator (the transaction and offsets topics are created then, while every broker is up to hold a
replica; the roles depend on both: readiness.py). Any failure reports the tail of the logs. `streamrft broker
check` prints how long a start took.

Data dir: one node keeps its files in the data dir itself; a cluster has ``node-1`` … ``node-N`` under it and one
``security/`` for all. stop() runs at interpreter exit (atexit), and no JVM outlives a dead owner (node.py).

Breaking it on purpose (bench/chaos.py, the cluster tests): :meth:`kill_node`, :meth:`stop_node`,
:meth:`start_node` (on the node's old ports; optionally with an empty disk), :meth:`wait_in_sync`, and where things
are: :meth:`controller`, :meth:`leader_of`, :meth:`transaction_coordinator`.
"""
from __future__ import annotations

import atexit
import base64
import logging
import os
import re
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path

from ..config.kafka import EmbeddedBrokerConfig
from ..errors import BrokerError
from . import placement
from .jars import Java, ensure_jars, find_java
from .node import HOST, BrokerNode, PortTaken, Quorum
from .data_dir import node_dir, prepare_data_dir
from .readiness import Readiness
from .security import BrokerSecurity
from .shutdown import await_exit, left_without_quorum
from .state import BrokerState

logger = logging.getLogger(__name__)



class _LibrdkafkaToDebug:
    """librdkafka logs refused connections at ERROR while the broker is still starting, which is expected
    here; pass its lines to our logger at DEBUG instead of stderr."""

    def log(self, level: int, msg: str, *args) -> None:
        logger.debug("librdkafka: " + msg, *args)


def free_ports(count: int) -> list[int]:
    """Ports the kernel considers free right now (all held at once, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def new_cluster_id() -> str:
    """A Kafka Uuid as `kafka-storage random-uuid` prints it (url-safe base64, no padding), without starting
    a JVM for it. Like Kafka, avoid ids starting with '-' (they read as command-line flags)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def heap_bytes(heap: str) -> int:
    """'512m' -> 536870912; raises BrokerError for what the JVM would not take."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", heap)
    if not match:
        raise BrokerError(f"broker.heap {heap!r} is not a JVM heap size such as 512m or 2g")
    return int(match.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2).lower()]


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


class EmbeddedBroker:
    """One KRaft node or a cluster of them. Use as a context manager, or call start() and stop().

    ``data_dir`` and ``keep_data`` override the config's. Without a data dir a temporary one is made. Unless
    ``keep_data``, the data dir is deleted at stop, given or not; a kept one is reused by the next start.
    """

    def __init__(
        self,
        config: EmbeddedBrokerConfig | None = None,
        data_dir: str | os.PathLike | None = None,
        keep_data: bool | None = None,
        *,
        detached: bool = False,
    ) -> None:
        self.config = config or EmbeddedBrokerConfig()
        chosen = data_dir if data_dir is not None else self.config.data_dir
        self._given_data_dir = Path(chosen).expanduser().resolve() if chosen else None
        self.keep_data = self.config.keep_data if keep_data is None else keep_data
        self.detached = detached
        self.security: BrokerSecurity | None = None  # with broker.security on: users, TLS, the admin
        self.data_dir: Path | None = None
        self.cluster_id: str | None = None
        self.startup_s: float | None = None
        self.nodes: list[BrokerNode] = []
        self._bootstrap: str | None = None
        self._java: Java | None = None
        self._admin = None

    # -- public --------------------------------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        """Every node's address (clients find the rest of the cluster from any one of them)."""
        if self._bootstrap is None:
            raise BrokerError("the embedded broker is not running; call start() or use it as a context manager")
        return self._bootstrap

    @property
    def pid(self) -> int | None:
        """The first node's JVM (the only one, for one node)."""
        return self.nodes[0].pid if self.nodes else None

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self.nodes if node.pid is not None]

    @property
    def log_file(self) -> Path | None:
        return self.nodes[0].log_file if self.nodes else None

    def running(self) -> bool:
        """Every node's JVM is alive."""
        return bool(self.nodes) and all(node.running() for node in self.nodes)

    def __enter__(self) -> "EmbeddedBroker":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> "EmbeddedBroker":
        if self.nodes:
            raise BrokerError("this EmbeddedBroker is already started")
        self._check_memory()
        began = time.monotonic()
        self._java = find_java()
        ensure_jars(self.config.kafka_version)
        self.data_dir = prepare_data_dir(self._given_data_dir, self.config.nodes)
        if self.config.security != "none":
            self.security = BrokerSecurity.prepare(self.config.security, self.data_dir, HOST)
        removes = None if self.keep_data else self.data_dir
        self.nodes = [BrokerNode(i, node_dir(self.data_dir, self.config.nodes, i), self.config, detached=self.detached, removes=removes)
                      for i in range(1, self.config.nodes + 1)]
        deadline = began + self.config.start_timeout_s
        atexit.register(self.stop)
        try:
            for attempt in range(3):
                self._configure(free_ports(2 * len(self.nodes)))
                self._format()
                for node in self.nodes:
                    node.launch(self._java)
                try:
                    Readiness(self).wait(deadline)
                    break
                except PortTaken:
                    logger.debug("a picked port was taken meanwhile (attempt %d); retrying", attempt + 1)
                    for node in self.nodes:
                        node.end(timeout=0)
            else:
                raise BrokerError(f"could not bind free loopback ports after 3 attempts; see {self.log_file}")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        logger.info("Kafka %s %s ready at %s in %.1f s (pids %s, data %s)", self.config.kafka_version, self.kind,
                    self._bootstrap, self.startup_s, " ".join(map(str, self.pids)), self.data_dir)
        return self

    @property
    def kind(self) -> str:
        """'broker' or '3-node cluster', for messages."""
        return "broker" if len(self.nodes) <= 1 else f"{len(self.nodes)}-node cluster"

    def stop(self, timeout: float = 20.0) -> None:
        """Graceful stop (SIGTERM), SIGKILL after ``timeout`` s; then delete the data unless keep_data.

        Every node gets its SIGTERM at once. A broker's controlled shutdown waits for the controller quorum's
        approval, so a node left running after a majority has exited cannot finish: it gets a short grace, then
        SIGKILL rather than the whole timeout (see broker/shutdown.py)."""
        atexit.unregister(self.stop)
        nodes, self.nodes, self._bootstrap = self.nodes, [], None
        for node in nodes:
            if node.running():
                _killpg(node.pid, signal.SIGTERM)
        await_exit([node.running for node in nodes], timeout)
        left = [node for node in nodes if node.running()]
        for node in left:
            if left_without_quorum(len(nodes), len(left)):  # expected: see above
                logger.info("node %d (pid %d) cannot finish its controlled shutdown without a controller quorum; "
                            "killing it", node.node_id, node.pid)
            else:
                logger.warning("node %d (pid %d) did not stop within %.0f s; killing it", node.node_id, node.pid,
                               timeout)
        for node in nodes:
            node.end(0 if node.running() else timeout)
        self._admin = None
        if self.data_dir is not None and not self.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def detach(self) -> BrokerState:
        """Give up ownership of a started, ``detached`` broker: its nodes keep running after this process exits.
        Returns what ``streamrft broker stop`` needs to stop them later."""
        if not self.detached or not self.running():
            raise BrokerError("only a running broker created with detached=True can be detached")
        atexit.unregister(self.stop)
        state = BrokerState(
            pid=self.pid, bootstrap_servers=self.bootstrap_servers, data_dir=str(self.data_dir),
            keep_data=self.keep_data, cluster_id=self.cluster_id or "", kafka_version=self.config.kafka_version,
            started_at=time.time(), pids=self.pids, nodes=len(self.nodes),
        )
        for node in self.nodes:
            node.proc = None
        return state

    def log_tail(self, lines: int = 30) -> str:
        """Last lines each node and its JVM wrote since the last launch, for error messages."""
        each = lines if len(self.nodes) <= 1 else max(10, lines // len(self.nodes))
        return "\n".join(filter(None, (node.log_tail(each) for node in self.nodes))) or "(the broker wrote no log)"

    # -- the cluster, broken on purpose and healed -----------------------------------------------------------------

    def node(self, node_id: int) -> BrokerNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise BrokerError(f"no node {node_id}: this broker has nodes 1 to {len(self.nodes)}")

    def kill_node(self, node_id: int) -> None:
        """SIGKILL a node's JVM (a crash: no controlled shutdown, nothing flushed)."""
        self.node(node_id).end(timeout=0)
        logger.info("node %d killed", node_id)

    def stop_node(self, node_id: int, timeout: float = 30.0) -> None:
        """Stop a node gracefully (SIGTERM: its controlled shutdown moves its partitions' leadership first)."""
        self.node(node_id).end(timeout)
        logger.info("node %d stopped", node_id)

    def start_node(self, node_id: int, *, empty_disk: bool = False, timeout: float | None = None) -> None:
        """Start a stopped node again on its old ports, with its data or, ``empty_disk``, none (a replaced disk:
        formatted anew for this cluster; it copies its replicas back from the others); return once it is a
        registered broker of our cluster again. Its replicas catch up after that (:meth:`wait_in_sync`)."""
        node = self.node(node_id)
        if empty_disk:
            node.wipe()
        node.format(self._java, self.cluster_id)
        node.launch(self._java)
        deadline = time.monotonic() + (timeout or self.config.start_timeout_s)
        readiness = Readiness(self)
        try:
            readiness.port(node, deadline)
            # "started" is logged once the node is an unfenced broker; the cluster's metadata may still list the
            # killed incarnation for a few seconds, so it cannot tell
            while not node.started():
                readiness.check(deadline, f"start node {node_id} again")
                time.sleep(0.1)
            readiness.metadata(deadline, brokers=len(self.nodes))
        except PortTaken:
            node.end(timeout=0)
            raise BrokerError(f"node {node_id} cannot listen on its old port {node.port} again: something else took "
                              "it meanwhile") from None
        logger.info("node %d back%s", node_id, " with an empty disk" if empty_disk else "")

    def wait_in_sync(self, timeout: float = 120.0) -> float:
        """Wait until every node is a registered broker and every partition (internal topics included) has a
        leader and all its replicas in sync: the cluster can lose any one node again. Returns the seconds waited."""
        began = time.monotonic()
        while True:
            try:
                problems = placement.not_in_sync(self.admin(), len(self.nodes), timeout=5)
            except Exception as exc:  # KafkaException: the cluster is still electing
                problems = [str(exc)]
            if not problems:
                return time.monotonic() - began
            if time.monotonic() - began > timeout:
                shown = "; ".join(problems[:8]) + (f"; … {len(problems) - 8} more" if len(problems) > 8 else "")
                raise BrokerError(f"the cluster was not back in sync within {timeout:.0f} s: {shown}\n"
                                  f"{self.log_tail()}")
            time.sleep(0.5)

    def controller(self) -> int | None:
        """The node id of the active KRaft controller (None while there is none)."""
        return placement.quorum_leader([node.storage for node in self.nodes if node.running()])

    def leader_of(self, topic: str, partition: int) -> int:
        return placement.leader_of(self.admin(), topic, partition)

    def transaction_coordinator(self, transactional_id: str) -> int:
        return placement.transaction_coordinator(self.admin(), transactional_id)

    def admin(self):
        """An AdminClient of the cluster (as its admin when security is on)."""
        from confluent_kafka.admin import AdminClient

        if self._admin is None:
            self._admin = AdminClient(self.client_properties())
        return self._admin

    def client_properties(self) -> dict:
        """librdkafka properties that reach this broker as its admin, quietly (see _LibrdkafkaToDebug)."""
        return {"bootstrap.servers": self.bootstrap_servers, "logger": _LibrdkafkaToDebug(),
                **(self.security.client_properties() if self.security else {})}

    # -- start-up steps ------------------------------------------------------------------------------------------

    def _check_memory(self) -> None:
        heap = heap_bytes(self.config.heap)
        available = available_memory()
        need = heap * self.config.nodes
        if available is not None and need > available:
            raise BrokerError(
                f"broker.nodes {self.config.nodes} × broker.heap {self.config.heap} is {need / 2**30:.1f} GiB of "
                f"heap, and this machine has {available / 2**30:.1f} GiB available; lower broker.heap (384m is "
                "enough for loopback runs) or broker.nodes")

    def _configure(self, ports: list[int]) -> None:
        """Two ports per node; every node a voter of the static KRaft quorum."""
        count = len(self.nodes)
        voters = ",".join(f"{node.node_id}@{HOST}:{ports[count + i]}" for i, node in enumerate(self.nodes))
        quorum = Quorum(voters, self.config.replication_factor, self.config.min_insync_replicas, cluster=count > 1)
        for i, node in enumerate(self.nodes):
            node.configure(ports[i], ports[count + i], quorum, self.security)
        self._bootstrap = ",".join(node.address for node in self.nodes)
        self._admin = None

    def _format(self) -> None:
        """One cluster id for every node: a kept data dir's (any formatted node's), else a new one. A node without
        storage (new, or its disk wiped) is formatted with it and copies its data from the others."""
        found = {node.cluster_id() for node in self.nodes} - {None}
        if len(found) > 1:
            raise BrokerError(f"the nodes in {self.data_dir} belong to different clusters "
                              f"({', '.join(sorted(found))}); give broker.data_dir / --data-dir a new or empty "
                              "directory")
        self.cluster_id = found.pop() if found else new_cluster_id()
        for node in self.nodes:
            node.format(self._java, self.cluster_id)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
