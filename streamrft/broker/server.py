"""A single-node KRaft Apache Kafka broker (broker and controller in one JVM) on loopback, for local runs and tests.

Start-up, in order: pick free ports → write server.properties → format the storage (once per data dir) →
launch the JVM → wait until it accepts connections, answers metadata with *our* cluster id (a port picked as
free can be taken by someone else's broker meanwhile) and can hand out a transactional producer id (the
transaction coordinator is loaded; the roles depend on transactions). Any failure reports the tail of the
broker's log. Measured here: ~2-3 s from start() to ready, of which ~1 s is librdkafka's fixed retry timers
while the coordinator loads.

Never orphaned: stop() runs at interpreter exit (atexit), and the JVM is launched behind a tiny shell watchdog
that holds a pipe from this process. If this process dies in any way, even SIGKILL, the pipe reaches EOF and
the watchdog stops the broker and removes its temporary data. (Java has no parent-death signal of its own.)
A ``detached`` broker (``streamrft broker start``) has no watchdog: it is meant to outlive its starter.
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
import subprocess
import tempfile
import time
import uuid
from importlib import resources
from pathlib import Path

from ..config.kafka import EmbeddedBrokerConfig
from ..errors import BrokerError
from .jars import classpath, ensure_jars, find_java, kafka_home
from .security import SECURITY_DIR, BrokerSecurity
from .state import BrokerState

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOG_FILE = "broker.log"  # written by log4j2 (see log4j2.properties)
JVM_OUT = "jvm.out"  # the JVM's own stdout/stderr: crashes, bad flags, class-data-sharing warnings

# Single node: every internal topic has one replica; few coordinator partitions, because creating and loading
# 50 of each (the defaults) only slows the first group join and the first transaction on one broker.
SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{host}:{controller_port}
listeners={listener}://{host}:{port},CONTROLLER://{host}:{controller_port}
advertised.listeners={listener}://{host}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name={listener}
log.dirs={log_dir}
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
auto.create.topics.enable=false
"""
PLAINTEXT_LISTENERS = "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n"

# Runs the JVM (exec keeps its pid) with a background subshell that blocks reading a pipe held by this Python
# process. At EOF (we closed it, or we died) it SIGTERMs the JVM, SIGKILLs it after 30 s, and removes
# $STREAMRFT_RMDIR if set. fd 3 because a background job's own stdin is /dev/null in a non-interactive sh.
_WATCHDOG = r"""exec 3<&0
(
  read _ <&3
  kill -TERM $$ 2>/dev/null
  i=0; while kill -0 $$ 2>/dev/null && [ $i -lt 150 ]; do sleep 0.2; i=$((i+1)); done
  kill -KILL $$ 2>/dev/null
  if [ -n "$STREAMRFT_RMDIR" ]; then rm -rf "$STREAMRFT_RMDIR"; fi
) &
exec 3<&- </dev/null
exec "$@"
"""


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


class _PortTaken(Exception):
    """The JVM could not bind a port we picked; start() retries with new ports."""


class EmbeddedBroker:
    """A KRaft broker+controller JVM. Use as a context manager, or call start() and stop().

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
        self._bootstrap: str | None = None
        self._proc: subprocess.Popen | None = None
        self._archive_tmp: Path | None = None
        self._archive: Path | None = None
        self._log_offsets: dict[str, int] = {}  # log sizes at launch: a kept data dir has older runs' logs

    # -- public --------------------------------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        if self._bootstrap is None:
            raise BrokerError("the embedded broker is not running; call start() or use it as a context manager")
        return self._bootstrap

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_file(self) -> Path | None:
        return self.data_dir / LOG_FILE if self.data_dir else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "EmbeddedBroker":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> "EmbeddedBroker":
        if self._proc is not None:
            raise BrokerError("this EmbeddedBroker is already started")
        if not re.fullmatch(r"\d+[kKmMgG]?", self.config.heap):
            raise BrokerError(f"broker.heap {self.config.heap!r} is not a JVM heap size such as 512m or 2g")
        began = time.monotonic()
        java = find_java()
        ensure_jars(self.config.kafka_version)
        self._prepare_data_dir()
        if self.config.security != "none":
            self.security = BrokerSecurity.prepare(self.config.security, self.data_dir, HOST)
        deadline = began + self.config.start_timeout_s
        atexit.register(self.stop)
        try:
            for attempt in range(3):
                ports = free_ports(2)
                self._write_config(ports[0], ports[1])
                self._format_storage(java)
                self._launch(java)
                try:
                    self._wait_ready(deadline)
                    break
                except _PortTaken:
                    logger.debug("a picked port was taken meanwhile (attempt %d); retrying", attempt + 1)
                    self._kill_and_reap()
            else:
                raise BrokerError(f"could not bind free loopback ports after 3 attempts; see {self.log_file}")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        logger.info("Kafka %s broker ready at %s in %.1f s (pid %d, data %s)", self.config.kafka_version,
                    self._bootstrap, self.startup_s, self._proc.pid, self.data_dir)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """Graceful stop (SIGTERM), SIGKILL after ``timeout`` s; then delete the data unless keep_data."""
        atexit.unregister(self.stop)
        proc, self._proc, self._bootstrap = self._proc, None, None
        if proc is not None:
            graceful = self._end(proc, timeout)
            self._keep_archive(graceful)
            logger.debug("broker pid %d stopped (exit %s)", proc.pid, proc.returncode)
        if self.data_dir is not None and not self.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def detach(self) -> BrokerState:
        """Give up ownership of a started, ``detached`` broker: it keeps running after this process exits.
        Returns what ``streamrft broker stop`` needs to stop it later."""
        if not self.detached or not self.running():
            raise BrokerError("only a running broker created with detached=True can be detached")
        atexit.unregister(self.stop)
        state = BrokerState(
            pid=self._proc.pid, bootstrap_servers=self.bootstrap_servers, data_dir=str(self.data_dir),
            keep_data=self.keep_data, cluster_id=self.cluster_id or "", kafka_version=self.config.kafka_version,
            started_at=time.time(),
        )
        self._proc = None
        return state

    def log_tail(self, lines: int = 30) -> str:
        """Last lines the broker and the JVM wrote since the last launch, for error messages."""
        parts = []
        for name in (LOG_FILE, JVM_OUT):
            path = self.data_dir / name if self.data_dir else None
            if path and path.exists():
                with open(path, "rb") as fh:
                    fh.seek(self._log_offsets.get(name, 0))
                    text = fh.read().decode(errors="replace").strip().splitlines()[-lines:]
                if text:
                    parts.append(f"--- {path} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts) or "(the broker wrote no log)"

    # -- start-up steps ------------------------------------------------------------------------------------------

    def _prepare_data_dir(self) -> None:
        if self._given_data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="streamrft-kafka-"))
        else:
            self.data_dir = self._given_data_dir
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # stop() deletes the data dir (unless keep_data): never adopt a directory holding anything else
            ours = {"kraft", "server.properties", "log4j2.properties", LOG_FILE, JVM_OUT, "classes.jsa", SECURITY_DIR}
            strangers = sorted(p.name for p in self.data_dir.iterdir() if p.name not in ours)
            if strangers:
                self.data_dir = None
                raise BrokerError(
                    f"{self._given_data_dir} holds files that are not the broker's ({', '.join(strangers[:5])}); "
                    "give broker.data_dir / --data-dir a new or empty directory"
                )
        (self.data_dir / "log4j2.properties").write_text(
            resources.files(__package__).joinpath("log4j2.properties").read_text()
        )

    def _write_config(self, port: int, controller_port: int) -> None:
        self._bootstrap = f"{HOST}:{port}"
        listener = "CLIENT" if self.security else "PLAINTEXT"
        properties = SERVER_PROPERTIES.format(host=HOST, port=port, controller_port=controller_port,
                                              log_dir=self.data_dir / "kraft", listener=listener)
        properties += self.security.server_properties() if self.security else PLAINTEXT_LISTENERS
        path = self.data_dir / "server.properties"
        path.touch()
        path.chmod(0o600)  # with security on it holds the admin's password
        path.write_text(properties)

    def _format_storage(self, java) -> None:
        """Format once per data dir; a kept data dir keeps its cluster id (with a static voter set the
        controller's port may change between starts)."""
        meta = self.data_dir / "kraft" / "meta.properties"
        if meta.exists():
            match = re.search(r"^cluster\.id=(\S+)", meta.read_text(), re.M)
            if match:
                self.cluster_id = match.group(1)
                return
        self.cluster_id = new_cluster_id()
        # A short-lived tool: the quick (C1) JIT and the class archive shave ~0.3 s off its ~0.7 s.
        cmd = [java.path, "-XX:TieredStopAtLevel=1", *self._class_sharing_flags(java, use_only=True),
               "-cp", self._classpath(), "kafka.tools.StorageTool", "format", "-t", self.cluster_id,
               "-c", str(self.data_dir / "server.properties"), "--ignore-formatted"]
        result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise BrokerError(f"formatting the broker storage in {self.data_dir} failed:\n"
                              f"{(result.stdout + result.stderr).strip()[-2000:]}")

    def _classpath(self) -> str:
        return os.pathsep.join(str(jar) for jar in classpath(self.config.kafka_version))

    def _launch(self, java) -> None:
        cmd = [
            java.path, f"-Xmx{self.config.heap}", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            f"-Dstreamrft.log.dir={self.data_dir}",
            *self._class_sharing_flags(java),
            "-cp", self._classpath(), "kafka.Kafka", str(self.data_dir / "server.properties"),
        ]
        env = dict(os.environ)
        env.pop("STREAMRFT_RMDIR", None)
        if not self.keep_data:
            env["STREAMRFT_RMDIR"] = str(self.data_dir)
        for name in (LOG_FILE, JVM_OUT):
            path = self.data_dir / name
            self._log_offsets[name] = path.stat().st_size if path.exists() else 0
        out = open(self.data_dir / JVM_OUT, "ab")
        try:
            # start_new_session: the JVM leads its own process group (stop() signals the whole group, watchdog
            # included) and a Ctrl-C meant for this process is not delivered to it twice.
            if self.detached:
                self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True, env=env)
            else:
                self._proc = subprocess.Popen(["/bin/sh", "-c", _WATCHDOG, "streamrft-kafka", *cmd],
                                              stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True, env=env)
        finally:
            out.close()
        logger.debug("started Kafka JVM pid %d for %s", self._proc.pid, self._bootstrap)

    def _class_sharing_flags(self, java, use_only: bool = False) -> list[str]:
        """Class-data sharing: the JVM maps the broker's classes from an archive instead of loading and
        verifying them, which cuts its start-up by ~0.7 s here. The first (non-detached) broker without an
        archive for this JVM writes one when it exits: into its data dir, so that an owner killed mid-way
        leaves no 50 MB stray in the cache, then moved into place."""
        self._archive = kafka_home(self.config.kafka_version) / f"classes-java{java.version}.jsa"
        self._archive_tmp = None
        if self._archive.exists():
            return [f"-XX:SharedArchiveFile={self._archive}", "-Xshare:auto"]
        if self.detached or use_only:
            return []
        self._archive_tmp = self.data_dir / "classes.jsa"
        return [f"-XX:ArchiveClassesAtExit={self._archive_tmp}"]

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

    def _wait_ready(self, deadline: float) -> None:
        from confluent_kafka import KafkaError, KafkaException, Producer
        from confluent_kafka.admin import AdminClient

        port = int(self._bootstrap.rpartition(":")[2])
        launched = time.monotonic()
        # 1. the JVM listens on its client port
        while True:
            self._check_alive(deadline, "open its client port")
            try:
                socket.create_connection((HOST, port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        logger.debug("port %d open %.2f s after launch", port, time.monotonic() - launched)
        quiet = {"bootstrap.servers": self._bootstrap, "logger": _LibrdkafkaToDebug(),
                 **(self.security.client_properties() if self.security else {})}
        # 2. it answers metadata, as our cluster
        admin = AdminClient(dict(quiet))
        while True:
            self._check_alive(deadline, "answer metadata")
            try:
                metadata = admin.list_topics(timeout=max(0.5, min(2.0, deadline - time.monotonic())))
            except KafkaException:
                time.sleep(0.05)
                continue
            if metadata.cluster_id != self.cluster_id:
                raise _PortTaken()  # someone else's Kafka answers on the port we picked
            break
        logger.debug("metadata answered %.2f s after launch", time.monotonic() - launched)
        # 3. the transaction coordinator hands out producer ids. The first request creates and loads its topic;
        # librdkafka retries "not available"/"loading" on its own fixed 500 ms timers (~1 s in all here). A
        # timed-out init_transactions() resumes where it left off when called again.
        transactional_id = f"streamrft-ready-probe-{uuid.uuid4().hex[:8]}"
        producer = Producer({**quiet, "transactional.id": transactional_id})
        while True:
            self._check_alive(deadline, "accept transactions")
            try:
                producer.init_transactions(max(0.1, min(2.0, deadline - time.monotonic())))
                break
            except KafkaException as exc:
                error = exc.args[0]
                if error.fatal():
                    raise BrokerError(f"the broker refused transactions: {error.str()}\n{self.log_tail()}") from exc
                logger.debug("init_transactions: %s", error)
                if error.code() != KafkaError._TIMED_OUT:
                    # e.g. COORDINATOR_LOAD_IN_PROGRESS handed back to us: start over with a fresh producer
                    producer = Producer({**quiet, "transactional.id": transactional_id})
        logger.debug("transactions usable %.2f s after launch", time.monotonic() - launched)
        close = getattr(producer, "close", None)  # Producer.close() only exists in newer confluent-kafka
        if close:
            close()

    def _check_alive(self, deadline: float, what: str) -> None:
        code = self._proc.poll()
        if code is not None:
            tail = self.log_tail()
            if "Address already in use" in tail:
                raise _PortTaken()
            raise BrokerError(
                f"the Kafka broker exited (code {code}) before it could {what}.\n{tail}\n"
                "Check the log above; a full disk, a data dir formatted by another Kafka version, or too "
                "little memory for broker.heap are the usual causes."
            )
        if time.monotonic() > deadline:
            raise BrokerError(
                f"the Kafka broker did not {what} within broker.start_timeout_s="
                f"{self.config.start_timeout_s:g} s.\n{self.log_tail()}\n"
                "On a slow or busy machine raise broker.start_timeout_s (STREAMRFT_BROKER__START_TIMEOUT_S)."
            )

    def _kill_and_reap(self) -> None:
        proc, self._proc = self._proc, None
        self._end(proc, timeout=0)
        self._keep_archive(False)

    def _end(self, proc: subprocess.Popen, timeout: float) -> bool:
        """Stop the JVM (SIGTERM to its group, SIGKILL after ``timeout`` s) and retire the watchdog. Returns
        whether the JVM ended by itself or by SIGTERM."""
        graceful = timeout > 0
        if proc.poll() is None:
            if graceful:
                self._signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("broker pid %d did not stop within %.0f s; killing it", proc.pid, timeout)
                    graceful = False
            if not graceful:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait()
        # The watchdog may outlive a JVM that died on its own. Kill it before closing its pipe, or it would
        # remove the data dir on its own schedule, even while a retry is using it. (Its being alive keeps the
        # group id reserved, so this cannot hit a stranger.)
        self._signal_group(proc, signal.SIGKILL)
        if proc.stdin:
            proc.stdin.close()
        return graceful

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
