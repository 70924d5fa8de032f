"""Java and the Apache Kafka jars the embedded broker runs on.

The jars are the official Maven Central artifacts, resolved once with ``mvn`` into a per-version cache
(``~/.cache/streamrft/kafka-<version>/lib``) so nothing is downloaded after set-up. Resolution happens in a
temporary directory that is renamed into place only when Maven succeeded, and a marker file records that, so
an interrupted download never leaves a half-filled cache that later looks complete.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import BrokerError

logger = logging.getLogger(__name__)

MIN_JAVA = 17  # Kafka 4.x brokers need Java 17+
MARKER = "resolved.ok"
_VERSION_RE = re.compile(r"^[0-9][0-9A-Za-z.\-]*$")


def cache_root() -> Path:
    """Where streamrft keeps downloads and broker state: STREAMRFT_CACHE_DIR, else $XDG_CACHE_HOME/streamrft,
    else ~/.cache/streamrft."""
    explicit = os.environ.get("STREAMRFT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "streamrft"


def kafka_home(version: str) -> Path:
    """Per-version directory: ``lib/`` with the jars, the completion marker, the class-data-sharing archive."""
    return cache_root() / f"kafka-{version}"


def parse_java_major(version_output: str) -> int:
    """Major Java version from ``java -version`` output: '1.8.0_292' -> 8, '17.0.15' -> 17, '21' -> 21,
    '22-ea' -> 22."""
    match = re.search(r'version "([^"]+)"', version_output)
    if not match:
        raise BrokerError(
            f"could not read the Java version from `java -version`, which printed: {version_output.strip()[:200]!r}; "
            f"install Java {MIN_JAVA}+ (e.g. `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME"
        )
    parts = re.split(r"[._\-+]", match.group(1))
    major = int(parts[1]) if parts[0] == "1" and len(parts) > 1 else int(re.match(r"\d+", parts[0]).group())
    return major


@dataclass(frozen=True)
class Java:
    path: str
    version: str  # as `java -version` prints it, e.g. "17.0.15"
    major: int


def find_java() -> Java:
    """The ``java`` executable ($JAVA_HOME/bin/java first, then PATH), checked to be Java 17 or newer."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home) / "bin" / "java" if java_home else None
    java = str(candidate) if candidate and candidate.exists() else shutil.which("java")
    if not java:
        raise BrokerError(
            f"the embedded Kafka broker needs Java {MIN_JAVA}+, and no `java` was found on PATH or in JAVA_HOME; "
            "install one (e.g. `apt-get install openjdk-17-jre-headless`), or point kafka.bootstrap_servers "
            "at an existing Kafka cluster"
        )
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrokerError(f"`{java} -version` failed ({exc}); check the Java installation or set JAVA_HOME") from exc
    text = out.stderr + out.stdout  # java -version prints to stderr
    major = parse_java_major(text)
    if major < MIN_JAVA:
        raise BrokerError(
            f"{java} is Java {major}; the embedded Kafka broker needs Java {MIN_JAVA}+. Install a newer JDK/JRE "
            "and put it first on PATH or set JAVA_HOME to it"
        )
    return Java(java, re.search(r'version "([^"]+)"', text).group(1), major)


def classpath(version: str) -> list[Path]:
    """The resolved jars, sorted: a stable order keeps the class-data-sharing archive valid between runs."""
    return sorted((kafka_home(version) / "lib").glob("*.jar"))


def jars_ready(version: str) -> bool:
    return (kafka_home(version) / MARKER).exists()


def ensure_jars(version: str = "4.1.1", quiet: bool = False) -> Path:
    """Return ``kafka-<version>/lib``, resolving the jars with Maven first if they are not cached yet."""
    if not _VERSION_RE.match(version):
        raise BrokerError(f"broker.kafka_version {version!r} is not a version number such as 4.1.1")
    pom = resources.files(__package__).joinpath("pom.xml").read_text().replace("@KAFKA_VERSION@", version)
    return resolve_maven_jars(kafka_home(version), pom, f"Apache Kafka {version}",
                              setup_hint="`streamrft broker setup`, or point kafka.bootstrap_servers at an "
                                         "existing Kafka cluster", quiet=quiet)


def resolve_maven_jars(home: Path, pom: str, what: str, *, setup_hint: str, extra_args: tuple[str, ...] = (),
                       quiet: bool = False) -> Path:
    """Return ``home/lib``, first resolving the dependencies that ``pom`` (a packaging pom) declares into it
    with ``mvn dependency:copy-dependencies``, unless the completion marker says they are there already.

    ``what`` names the artifacts in messages; ``setup_hint`` says what the user runs to resolve them ahead of
    time (or instead). Used for every Java server streamrft runs (the broker, s3proxy, ...), so each one's
    cache is complete or absent the same way."""
    if (home / MARKER).exists():
        return home / "lib"
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            f"the {what} jars are not in {home} yet, and resolving them needs Maven (`mvn`); install it (e.g. "
            f"`apt-get install maven`) and run {setup_hint}"
        )
    find_java()  # fail on a missing/old Java now rather than after the download

    home.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{home.name}.", dir=home.parent))
    try:
        (staging / "pom.xml").write_text(pom)
        cmd = [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(staging / "pom.xml"), "dependency:copy-dependencies",
               f"-DoutputDirectory={staging / 'lib'}", "-DincludeScope=runtime", *extra_args]
        logger.info("resolving the %s jars with Maven into %s (first run only)", what, home)
        result = _run_with_status(cmd, f"Resolving the {what} jars with Maven (first run only)…", quiet)
        jars = list((staging / "lib").glob("*.jar"))
        if result.returncode != 0 or not jars:
            tail = "\n".join(result.stdout.strip().splitlines()[-15:])
            raise BrokerError(
                f"Maven could not resolve the {what} jars (exit {result.returncode}); check the version exists "
                f"and that Maven can reach its repository (proxy settings in ~/.m2/settings.xml). Maven said:\n{tail}"
            )
        (staging / MARKER).write_text(f"{len(jars)} jars\n")
        os.chmod(staging, 0o755)  # mkdtemp made it private; the cache may be shared
        try:
            os.rename(staging, home)  # atomic: the cache is either complete or absent
        except OSError:
            if not (home / MARKER).exists():
                # A leftover without marker (say, a cache dir made by hand): replace it.
                shutil.rmtree(home, ignore_errors=True)
                os.rename(staging, home)
            # else: a concurrent resolve won the race; its result is as good as ours.
        logger.info("resolved %d jars for %s", len(jars), what)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return home / "lib"


def _run_with_status(cmd: list[str], message: str, quiet: bool) -> subprocess.CompletedProcess:
    """Run Maven, showing a spinner on stderr (it takes seconds to minutes, and -q prints nothing)."""
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL)

    if quiet:
        return run()
    from rich.console import Console

    with Console(stderr=True).status(message):
        return run()
