"""The Go and Java clients of tests/interop, built once per version of their sources into a cache outside the
repository (``$STREAMRFT_INTEROP_CACHE``, default ``~/.cache/streamrft-interop``): the Go module and build
caches, the Maven repository, and one build per digest of the sources, so a test session finds them built and
later builds download nothing. ``scripts/setup.sh --dev`` runs this file to build (and so fetch) both ahead.

    python tests/interop/toolchains.py      build both; a missing toolchain is reported, not an error
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GO_SOURCES = HERE / "go"
JAVA_SOURCES = HERE / "java"
GO_MINIMUM = (1, 26)  # franz-go 1.22's go.mod asks for it
JAVA_MINIMUM = 17
JAVA_MAIN = "io.streamrft.interop.Main"
# A client runs for seconds: the quick JIT and the serial collector start it sooner; its Kafka client logs
# warnings only.
JVM_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")


class ToolchainMissing(Exception):
    """A language's toolchain is not on this machine; the message says what to install."""


@dataclass(frozen=True)
class Client:
    """A built client: ``argv`` runs it; ``run`` passes a subcommand and its options and returns its JSON."""

    language: str
    argv: tuple[str, ...]

    def run(self, command: str, timeout: float = 120, **options: object) -> dict:
        args = [*self.argv, command]
        for name, value in options.items():  # Go's flag package takes --name as well as -name
            args += [f"--{name.replace('_', '-')}", str(value)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"the {self.language} client's `{command}` exited {done.returncode}:\n"
                                 f"{done.stderr[-4000:]}\n{done.stdout[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def cache_dir() -> Path:
    configured = os.environ.get("STREAMRFT_INTEROP_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "streamrft-interop"


def _digest(folder: Path) -> str:
    """Of every source file's path and bytes: a changed source is a new build, an unchanged one is reused."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "target" not in p.parts):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@contextmanager
def _locked(name: str):
    """One build at a time per language, across processes (pytest-xdist workers, a setup.sh beside a test run)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(args: list[str], what: str, **kwargs) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {' '.join(args)}\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout


def _version(text: str) -> tuple[int, ...]:
    match = re.search(r"(\d+)\.(\d+)", text)
    return tuple(int(part) for part in match.groups()) if match else (0, 0)


def _go() -> str:
    go = shutil.which("go") or next((p for p in ("/usr/local/go/bin/go",) if os.access(p, os.X_OK)), None)
    if go is None:
        raise ToolchainMissing("Go is not installed (the Go client needs Go 1.26+: the golang package, or Go's "
                               "own distribution on PATH)")
    found = _run([go, "env", "GOVERSION"], "go env").strip()
    if _version(found) < GO_MINIMUM:
        raise ToolchainMissing(f"Go {'.'.join(map(str, GO_MINIMUM))}+ is needed for the Go client, found {found}")
    return go


def go_environment() -> dict[str, str]:
    """The Go caches under the interop cache; the toolchain on this machine, never a downloaded one."""
    root = cache_dir() / "go"
    return {**os.environ, "GOMODCACHE": str(root / "mod"), "GOCACHE": str(root / "build"), "GOFLAGS": "-mod=mod",
            "GOTOOLCHAIN": "local"}


def build_go() -> Client:
    go = _go()
    binary = cache_dir() / "go" / "bin" / f"interop-{_digest(GO_SOURCES)}"
    with _locked("go"):
        if not binary.exists():
            binary.parent.mkdir(parents=True, exist_ok=True)
            partial = binary.with_suffix(".partial")
            _run([go, "build", "-o", str(partial), "."], "building the Go client", cwd=GO_SOURCES,
                 env=go_environment())
            partial.rename(binary)
    return Client("go", (str(binary),))


def _java() -> tuple[str, str]:
    java, javac, mvn = shutil.which("java"), shutil.which("javac"), shutil.which("mvn")
    if java is None or javac is None:
        raise ToolchainMissing("a Java 17+ JDK is not installed (the Java client needs javac: the "
                               "openjdk-17-jdk-headless package)")
    if mvn is None:
        raise ToolchainMissing("Apache Maven is not installed (the Java client is built with it: the maven package)")
    answer = subprocess.run([javac, "-version"], capture_output=True, text=True)
    found = (answer.stdout + answer.stderr).strip()  # "javac 17.0.15"
    if _version(found)[0] < JAVA_MINIMUM:
        raise ToolchainMissing(f"Java {JAVA_MINIMUM}+ is needed for the Java client, found {found}")
    return java, mvn


def build_java() -> Client:
    java, mvn = _java()
    build = cache_dir() / "java" / _digest(JAVA_SOURCES)
    done = build / "built"
    with _locked("java"):
        if not done.exists():
            _run([mvn, "-B", "-q", f"-Dmaven.repo.local={cache_dir() / 'm2'}", f"-Dinterop.build={build}",
                  "-f", str(JAVA_SOURCES / "pom.xml"), "compile", "dependency:build-classpath"],
                 "building the Java client", env={**os.environ, "MAVEN_OPTS": "-Xmx512m"})
            done.touch()
    classpath = f"{build / 'classes'}:{(build / 'classpath.txt').read_text().strip()}"
    return Client("java", (java, *JVM_FLAGS, "-cp", classpath, JAVA_MAIN))


BUILDERS = {"go": build_go, "java": build_java}


def main() -> int:
    for language, build in BUILDERS.items():
        try:
            client = build()
        except ToolchainMissing as missing:
            print(f"interop: no {language} client: {missing}; its tests in tests/interop will be skipped")
            continue
        print(f"interop: {language} client built ({client.argv[0] if language == 'go' else cache_dir() / 'java'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
