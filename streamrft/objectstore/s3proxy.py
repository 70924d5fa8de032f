"""s3proxy: an S3-compatible server (Apache jclouds' filesystem backend, one directory per bucket) run on
loopback, the way the embedded broker runs Kafka: the jar is resolved once from Maven Central into the streamrft
cache (``streamrft.broker.jars.resolve_maven_jars``), the server starts on a free port, is ready when it answers
HTTP, and stops (or is killed, for crash tests) on request.

Its settings, the access key's secret among them, go in a properties file in a private temporary directory
(mode 0700), never on the command line where ``ps`` would show them.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from ..broker.jars import cache_root, find_java, resolve_maven_jars
from ..broker.watchdog import watched
from ..errors import StreamrftError

logger = logging.getLogger(__name__)

S3PROXY_VERSION = "4.1.0"  # the last release that runs on Java 17
JVM_OPTIONS = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")  # a small test server: start fast, stay small


class S3ProxyError(StreamrftError):
    """s3proxy could not be resolved, started or reached."""


def s3proxy_home(version: str = S3PROXY_VERSION) -> Path:
    return cache_root() / f"s3proxy-{version}"


def ensure_s3proxy(version: str = S3PROXY_VERSION, quiet: bool = False) -> Path:
    """The s3proxy jar, resolved with Maven first if it is not cached yet (``streamrft s3 setup`` does it ahead)."""
    pom = resources.files(__package__).joinpath("pom.xml").read_text().replace("@S3PROXY_VERSION@", version)
    lib = resolve_maven_jars(s3proxy_home(version), pom, f"s3proxy {version}", setup_hint="`streamrft s3 setup`",
                             quiet=quiet)
    jars = sorted(lib.glob("s3proxy-*.jar"))
    if not jars:
        raise S3ProxyError(f"no s3proxy jar in {lib}; delete {lib.parent} and run `streamrft s3 setup` again")
    return jars[0]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class S3Proxy:
    """One s3proxy process serving ``basedir`` (a bucket per subdirectory) at ``http://127.0.0.1:<port>``, with
    one access key. ``start`` again after ``stop``/``kill`` serves the same directory on the same port."""

    def __init__(self, basedir: Path, access_key_id: str, secret_access_key: str, *, port: int = 0,
                 version: str = S3PROXY_VERSION, start_timeout_s: float = 60.0):
        self.basedir = Path(basedir)
        self.access_key_id = access_key_id
        self._secret = secret_access_key
        self.port = port or free_port()
        self.version = version
        self.start_timeout_s = start_timeout_s
        self.startup_s = 0.0
        self._process: subprocess.Popen | None = None
        self._rundir: Path | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> "S3Proxy":
        """Start the server and wait until it answers HTTP (S3ProxyError, with its log's tail, if it does not)."""
        if self._process is not None and self._process.poll() is None:
            return self
        jar = ensure_s3proxy(self.version, quiet=True)
        java = find_java().path
        self.basedir.mkdir(parents=True, exist_ok=True)
        self._rundir = Path(tempfile.mkdtemp(prefix="streamrft-s3proxy-"))  # private: it holds the secret
        properties = self._rundir / "s3proxy.properties"
        properties.write_text(self._properties())
        log = open(self._rundir / "s3proxy.log", "wb")
        started = time.monotonic()
        with log:
            # under the watchdog (its pipe is our stdin to it), in the caller's process group: whether the owner
            # exits, is killed or is interrupted, the server goes with it
            command = [java, *JVM_OPTIONS, "-jar", str(jar), "--properties", str(properties)]
            self._process = subprocess.Popen(watched("streamrft-s3proxy", command), stdin=subprocess.PIPE,
                                             stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(started)
        self.startup_s = time.monotonic() - started
        logger.info("s3proxy %s serving %s at %s (started in %.2f s)", self.version, self.basedir,
                    self.endpoint_url, self.startup_s)
        return self

    def _properties(self) -> str:
        return "\n".join([
            f"s3proxy.endpoint={self.endpoint_url}",
            "s3proxy.authorization=aws-v2-or-v4",
            f"s3proxy.identity={self.access_key_id}",
            f"s3proxy.credential={self._secret}",
            "jclouds.provider=filesystem",
            f"jclouds.filesystem.basedir={self.basedir.resolve()}",
            "",
        ])

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = self.log_tail()
                self._cleanup()
                raise S3ProxyError(f"s3proxy exited with code {self._process.returncode} while starting on "
                                   f"{self.endpoint_url}; is the port taken, or the directory unwritable? "
                                   f"Its log ends:\n{tail}")
            if self._answers():
                return
            time.sleep(0.05)
        tail = self.log_tail()
        self.kill()
        raise S3ProxyError(f"s3proxy did not answer at {self.endpoint_url} within {self.start_timeout_s:.0f} s; "
                           f"its log ends:\n{tail}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint_url + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # 403 for an unsigned request: the server is up
        except OSError:
            return False
        return True

    def log_tail(self, lines: int = 20) -> str:
        path = self._rundir / "s3proxy.log" if self._rundir else None
        if path is None or not path.exists():
            return "(no log)"
        text = path.read_text(errors="replace").replace(self._secret, "<secret>")
        return "\n".join(text.splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """The server's resident memory now (Linux), 0 when it is not running."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, TypeError, ValueError):
            pass
        return 0

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed or closed."""
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._process is not None and self._process.stdin and not self._process.stdin.closed:
            self._process.stdin.close()  # the watchdog's pipe: it has nothing left to stop
        if self._rundir is not None:
            shutil.rmtree(self._rundir, ignore_errors=True)
            self._rundir = None

    def __enter__(self) -> "S3Proxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
