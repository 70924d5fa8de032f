"""The embedded schema registry: Apicurio Registry (in-memory storage) on loopback, serving the Confluent
schema-registry API under ``/apis/ccompat/v7``, which confluent-kafka's ``SchemaRegistryClient`` speaks.

Start-up: resolve the app (artifact.py) → pick two free ports (HTTP and Quarkus' management interface, both
bound to 127.0.0.1: the management one would open on every interface otherwise) → launch the JVM behind the
broker's watchdog (if this process dies, even by SIGKILL, the JVM is stopped and its directory removed) → ready
when ``GET /subjects`` answers → set the global compatibility rule. A port taken meanwhile by someone else is
retried on new ports. stop() runs at interpreter exit too.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..broker.jars import find_java
from ..broker.watchdog import watched
from ..broker.server import free_ports
from ..config import SchemaRegistryConfig
from ..errors import RegistryError
from .artifact import ensure_registry

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
API = "/apis/ccompat/v7"
LOG_FILE = "registry.log"  # the JVM's stdout and stderr (Quarkus logs to the console)
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
PORT_ATTEMPTS = 3
# A registry holds a few dozen schemas: the serial collector and the quick (C1) JIT keep it small and start it
# sooner; it answers a handful of requests per run, so peak throughput does not matter.
JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:+ExitOnOutOfMemoryError",
             "-Djava.awt.headless=true")


class _PortTaken(Exception):
    pass


class EmbeddedRegistry:
    """One Apicurio Registry JVM. ``url`` is what ``schema_registry.url`` should be for clients of it.
    ``data_dir``: keep the schemas there (an H2 file), so records written before a restart keep decoding by
    their schema ids; None: in memory, gone at stop."""

    def __init__(self, config: SchemaRegistryConfig | None = None, data_dir: Path | None = None):
        self.config = config or SchemaRegistryConfig()
        self.data_dir = data_dir
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.directory: Path | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RegistryError("the embedded registry is not started; call start() first")
        return f"http://{HOST}:{self.port}{API}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "EmbeddedRegistry":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- start ---------------------------------------------------------------------------------------------------
    def start(self) -> "EmbeddedRegistry":
        if self.running():
            raise RegistryError(f"the embedded registry is already running at {self.url} (pid {self.pid})")
        jar = ensure_registry(self.config.embedded_version)
        java = find_java()
        self.directory = Path(tempfile.mkdtemp(prefix="streamrft-registry-"))
        atexit.register(self.stop)
        began = time.monotonic()
        try:
            for attempt in range(PORT_ATTEMPTS):
                self._launch(java.path, jar, *free_ports(2))
                try:
                    self._wait_ready(began + self.config.embedded_start_timeout_s)
                    break
                except _PortTaken:
                    self._end(0)
                    logger.info("a port of the registry was taken meanwhile; trying new ports (%d)", attempt + 1)
            else:
                raise RegistryError(f"the registry could not bind free ports in {PORT_ATTEMPTS} tries; see "
                                    f"{self.directory / LOG_FILE}")
            self._set_compatibility(self.config.compatibility)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        logger.info("schema registry (Apicurio %s) up at %s in %.1f s, pid %d", self.config.embedded_version,
                    self.url, self.startup_s, self.pid)
        return self

    def _launch(self, java: str, jar: Path, port: int, management_port: int) -> None:
        self.port = port
        cmd = [java, f"-Xmx{self.config.embedded_heap}", *JVM_FLAGS,
               f"-Dquarkus.http.host={HOST}", f"-Dquarkus.http.port={port}",
               f"-Dquarkus.management.host={HOST}", f"-Dquarkus.management.port={management_port}",
               "-Dquarkus.http.access-log.enabled=false", *self._storage_flags(), "-jar", str(jar)]
        env = {**os.environ, "STREAMRFT_RMDIR": str(self.directory)}
        with open(self.directory / LOG_FILE, "ab") as out:
            # The watchdog holds a pipe from this process: at its EOF the JVM is stopped and the directory removed.
            self.proc = subprocess.Popen(watched("streamrft-registry", cmd), cwd=self.directory,
                                         stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)

    def _storage_flags(self) -> list[str]:
        if self.data_dir is None:
            return []
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return [f"-Dapicurio.datasource.url=jdbc:h2:file:{self.data_dir.resolve() / 'schemas'}"]

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if "Address already in use" in tail or "Port already bound" in tail:
                    raise _PortTaken()
                raise RegistryError(f"the schema registry JVM exited (code {self.proc.returncode}) before it "
                                    f"answered.\n{tail}\nToo little memory for schema_registry.embedded_heap, or "
                                    "a Java older than 17, are the usual causes.")
            if self._answers():
                return
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"the schema registry did not answer at {self.url} within "
                    f"{self.config.embedded_start_timeout_s:.0f} s.\n{self.log_tail()}\nRaise "
                    "schema_registry.embedded_start_timeout_s on a slow or busy machine.")
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _set_compatibility(self, level: str) -> None:
        body = json.dumps({"compatibility": level}).encode()
        request = urllib.request.Request(f"{self.url}/config", data=body, method="PUT",
                                         headers={"Content-Type": CONTENT_TYPE})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.loads(response.read() or b"{}")
        except urllib.error.URLError as exc:
            raise RegistryError(f"the registry at {self.url} refused the compatibility rule {level}: {exc}") from exc
        if answer.get("compatibilityLevel", answer.get("compatibility")) != level:
            raise RegistryError(f"the registry at {self.url} answered {answer} when asked for compatibility {level}")

    # -- what it costs -------------------------------------------------------------------------------------------
    def rss_bytes(self) -> int:
        """The JVM's resident memory now (the watchdog's shell exec'd into it, so the pid is the JVM's)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except (OSError, TypeError):
            return 0
        line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), "VmRSS: 0 kB")
        return int(line.split()[1]) * 1024

    def log_tail(self, lines: int = 30) -> str:
        path = self.directory / LOG_FILE if self.directory else None
        if path is None or not path.exists():
            return ""
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
        return f"--- {path} (last {len(text)} lines) ---\n" + "\n".join(text)

    # -- stop ----------------------------------------------------------------------------------------------------
    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (Quarkus shuts down in about a second), SIGKILL after ``timeout`` s; then remove its
        directory."""
        atexit.unregister(self.stop)
        self._end(timeout)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _end(self, timeout: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None and timeout > 0:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the schema registry (pid %d) did not stop within %.0f s; killing it", proc.pid,
                               timeout)
        # The JVM's group holds the watchdog too: kill it before closing its pipe, so it removes nothing on its own.
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdin:
            proc.stdin.close()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
