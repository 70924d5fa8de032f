"""One KRaft node of the embedded broker: a JVM that is broker and controller at once, with its own data
directory and two ports (clients, controllers). ``EmbeddedBroker`` (server.py) runs one node, or several as a
replicated cluster; everything about a single JVM lives here: its server.properties, formatting its storage,
launching it and stopping it.

Never orphaned: the JVM is launched behind a tiny shell watchdog that holds a pipe from this process. If this
process dies in any way, even SIGKILL, the pipe reaches EOF and the watchdog stops the JVM and removes the
broker's temporary data. (Java has no parent-death signal of its own.) A ``detached`` node (``streamrft broker
start``) has no watchdog: it is meant to outlive its starter.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..config.kafka import EmbeddedBrokerConfig
from ..errors import BrokerError
from .jars import Java, classpath, kafka_home
from .security import BrokerSecurity
from .watchdog import watched

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOG_FILE = "broker.log"  # written by log4j2 (see log4j2.properties)
JVM_OUT = "jvm.out"  # the JVM's own stdout/stderr: crashes, bad flags, class-data-sharing warnings
STORAGE = "kraft"  # log.dirs: the metadata log and the topics' partitions
STARTED_MESSAGE = b"Kafka Server started"  # KafkaRaftServer, after the broker's startup (see log4j2.properties)

# Few coordinator partitions, because creating and loading 50 of each (the defaults) only slows the first group
# join and the first transaction on a loopback broker. Internal topics are replicated like every other.
SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id={node_id}
controller.quorum.voters={voters}
listeners={listener}://{host}:{port},CONTROLLER://{host}:{controller_port}
advertised.listeners={listener}://{host}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name={listener}
log.dirs={log_dir}
num.partitions=1
default.replication.factor={replicas}
min.insync.replicas={min_insync}
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=4
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_insync}
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_insync}
group.initial.rebalance.delay.ms=0
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
auto.create.topics.enable=false
"""
# A cluster fences a broker that missed heartbeats for this long and moves its partitions' leadership away:
# the pause a SIGKILLed broker costs its partitions. Kafka's defaults (9 s / 2 s) are for networks; on loopback a
# missed second is a dead JVM. The coordinators look for transactions past their timeout every second (Kafka:
# 10 s), so a dead worker's open transaction holds read_committed readers for its timeout, not up to 10 s more.
CLUSTER_PROPERTIES = """\
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
"""
PLAINTEXT_LISTENERS = "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n"

class PortTaken(Exception):
    """The JVM could not bind a port we picked (someone took it meanwhile)."""


@dataclass(frozen=True)
class Quorum:
    """What every node's server.properties shares: the voters, and the replication the cluster's size allows."""

    voters: str  # "1@127.0.0.1:PORT,2@..." (static KRaft voters: every node)
    replicas: int
    min_insync: int
    cluster: bool


class BrokerNode:
    """One JVM: ``node_id`` (from 1), its data in ``directory``. ``removes`` is the directory its watchdog deletes
    if this process dies (the broker's whole temporary data dir; None: keep it)."""

    def __init__(self, node_id: int, directory: Path, config: EmbeddedBrokerConfig, *, detached: bool,
                 removes: Path | None):
        self.node_id = node_id
        self.directory = directory
        self.config = config
        self.detached = detached
        self.removes = removes
        self.port: int | None = None
        self.controller_port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._archive: Path | None = None
        self._archive_tmp: Path | None = None
        self._log_offsets: dict[str, int] = {}  # log sizes at launch: a kept data dir has older runs' logs

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_file(self) -> Path:
        return self.directory / LOG_FILE

    @property
    def storage(self) -> Path:
        return self.directory / STORAGE

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __repr__(self) -> str:
        return f"node {self.node_id} ({self.address}, pid {self.pid})"

    # -- start-up steps ------------------------------------------------------------------------------------------

    def configure(self, port: int, controller_port: int, quorum: Quorum, security: BrokerSecurity | None) -> None:
        """Write server.properties for these ports (mode 0600: with security on it holds the admin's password)."""
        self.port, self.controller_port = port, controller_port
        self.directory.mkdir(parents=True, exist_ok=True)
        listener = "CLIENT" if security else "PLAINTEXT"
        properties = SERVER_PROPERTIES.format(
            node_id=self.node_id, voters=quorum.voters, host=HOST, port=port, controller_port=controller_port,
            log_dir=self.storage, listener=listener, replicas=quorum.replicas, min_insync=quorum.min_insync)
        properties += CLUSTER_PROPERTIES if quorum.cluster else ""
        properties += security.server_properties() if security else PLAINTEXT_LISTENERS
        path = self.directory / "server.properties"
        path.touch()
        path.chmod(0o600)
        path.write_text(properties)

    def cluster_id(self) -> str | None:
        """The cluster id this node's storage was formatted with; None when it is not formatted (new, or wiped)."""
        meta = self.storage / "meta.properties"
        match = re.search(r"^cluster\.id=(\S+)", meta.read_text(), re.M) if meta.exists() else None
        return match.group(1) if match else None

    def format(self, java: Java, cluster_id: str) -> None:
        """Format the storage once: a formatted node keeps its data (with a static voter set the ports may change
        between starts). A node formatted for another cluster is refused, not mixed in."""
        found = self.cluster_id()
        if found == cluster_id:
            return
        if found is not None:
            raise BrokerError(f"node {self.node_id}'s storage {self.storage} belongs to cluster {found}, the others' "
                              f"to {cluster_id}; give broker.data_dir / --data-dir a new or empty directory")
        # A short-lived tool: the quick (C1) JIT and the class archive start it faster.
        cmd = [java.path, "-XX:TieredStopAtLevel=1", *self._class_sharing_flags(java, use_only=True),
               "-cp", self._classpath(), "kafka.tools.StorageTool", "format", "-t", cluster_id,
               "-c", str(self.directory / "server.properties"), "--ignore-formatted"]
        result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise BrokerError(f"formatting node {self.node_id}'s storage in {self.storage} failed:\n"
                              f"{(result.stdout + result.stderr).strip()[-2000:]}")

    def wipe(self) -> None:
        """Lose this node's data, as a replaced disk does (the node must be stopped; format() makes it new)."""
        if self.running():
            raise BrokerError(f"node {self.node_id} is running; stop it before wiping its storage")
        shutil.rmtree(self.storage, ignore_errors=True)

    def launch(self, java: Java) -> None:
        if self.running():
            raise BrokerError(f"node {self.node_id} is already running (pid {self.pid})")
        cmd = [
            java.path, f"-Xmx{self.config.heap}", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}",
            f"-Dstreamrft.log.dir={self.directory}",
            *self._class_sharing_flags(java),
            "-cp", self._classpath(), "kafka.Kafka", str(self.directory / "server.properties"),
        ]
        env = dict(os.environ)
        env.pop("STREAMRFT_RMDIR", None)
        if self.removes is not None:
            env["STREAMRFT_RMDIR"] = str(self.removes)
        for name in (LOG_FILE, JVM_OUT):
            path = self.directory / name
            self._log_offsets[name] = path.stat().st_size if path.exists() else 0
        out = open(self.directory / JVM_OUT, "ab")
        try:
            # start_new_session: the JVM leads its own process group (end() signals the whole group, watchdog
            # included) and a Ctrl-C meant for this process is not delivered to it twice.
            if self.detached:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=env)
            else:
                self.proc = subprocess.Popen(watched("streamrft-kafka", cmd),
                                             stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=env)
        finally:
            out.close()
        logger.debug("started Kafka JVM pid %d for node %d at %s", self.proc.pid, self.node_id, self.address)

    def _classpath(self) -> str:
        return os.pathsep.join(str(jar) for jar in classpath(self.config.kafka_version))

    def _class_sharing_flags(self, java: Java, use_only: bool = False) -> list[str]:
        """Class-data sharing: the JVM maps the broker's classes from an archive instead of loading and
        verifying them, which shortens its start-up. Without an archive for this JVM, node 1 of the
        first non-detached broker writes one when it exits: into its data dir, so that an owner killed mid-way
        leaves no 50 MB stray in the cache, then moved into place."""
        self._archive = kafka_home(self.config.kafka_version) / f"classes-java{java.version}.jsa"
        self._archive_tmp = None
        if self._archive.exists():
            return [f"-XX:SharedArchiveFile={self._archive}", "-Xshare:auto"]
        if self.detached or use_only or self.node_id != 1:
            return []
        self._archive_tmp = self.directory / "classes.jsa"
        return [f"-XX:ArchiveClassesAtExit={self._archive_tmp}"]

    def check_alive(self, what: str) -> None:
        """Raise PortTaken or BrokerError (with the log's tail) when the JVM has exited."""
        code = self.proc.poll()
        if code is None:
            return
        tail = self.log_tail()
        if "Address already in use" in tail:
            raise PortTaken()
        raise BrokerError(
            f"Kafka node {self.node_id} exited (code {code}) before it could {what}.\n{tail}\n"
            "Check the log above; a full disk, a data dir formatted by another Kafka version, or too "
            "little memory for broker.heap are the usual causes."
        )

    # -- stopping ------------------------------------------------------------------------------------------------

    def end(self, timeout: float) -> bool:
        """Stop the JVM (SIGTERM to its group, SIGKILL after ``timeout`` s; at once with ``timeout`` 0) and retire
        the watchdog. Returns whether the JVM ended by itself or by SIGTERM."""
        proc, self.proc = self.proc, None
        if proc is None:
            return True
        graceful = timeout > 0
        if proc.poll() is None:
            if graceful:
                _killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("node %d (pid %d) did not stop within %.0f s; killing it", self.node_id,
                                   proc.pid, timeout)
                    graceful = False
            if not graceful:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # The watchdog may outlive a JVM that died on its own. Kill it before closing its pipe, or it would
        # remove the data dir on its own schedule, even while a restart is using it. (Its being alive keeps the
        # group id reserved, so this cannot hit a stranger.)
        _killpg(proc.pid, signal.SIGKILL)
        if proc.stdin:
            proc.stdin.close()
        self._keep_archive(graceful)
        logger.debug("node %d (pid %d) stopped (exit %s)", self.node_id, proc.pid, proc.returncode)
        return graceful

    def _keep_archive(self, graceful: bool) -> None:
        tmp, self._archive_tmp = self._archive_tmp, None
        if tmp is None or not tmp.exists():
            return
        if graceful and tmp.stat().st_size > 0 and not self._archive.exists():
            staging = self._archive.with_name(f".{self._archive.name}.{os.getpid()}")
            shutil.move(tmp, staging)  # may cross file systems (data dir in /tmp)
            os.replace(staging, self._archive)
            logger.debug("wrote class-data archive %s", self._archive)
        else:
            tmp.unlink(missing_ok=True)

    def started(self) -> bool:
        """The JVM launched last logged that it is up: Kafka logs it once the node is an unfenced broker."""
        path = self.directory / LOG_FILE
        if not path.exists():
            return False
        with open(path, "rb") as fh:
            fh.seek(self._log_offsets.get(LOG_FILE, 0))
            return STARTED_MESSAGE in fh.read()

    def log_tail(self, lines: int = 30) -> str:
        """Last lines the node and its JVM wrote since the last launch, for error messages."""
        parts = []
        for name in (LOG_FILE, JVM_OUT):
            path = self.directory / name
            if path.exists():
                with open(path, "rb") as fh:
                    fh.seek(self._log_offsets.get(name, 0))
                    text = fh.read().decode(errors="replace").strip().splitlines()[-lines:]
                if text:
                    parts.append(f"--- {path} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
