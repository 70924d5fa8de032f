"""Apicurio Registry's distribution, resolved once with Maven into the streamrft cache
(``~/.cache/streamrft/apicurio-registry-<version>/lib``) the way the broker's jars are
(``streamrft.broker.jars.resolve_maven_jars``: a temporary directory renamed into place with a marker).

The app is one archive on Maven Central (``io.apicurio:apicurio-registry-app:<v>:tar.gz:all``: a runner jar and
its ``lib/``). Its pom's parent is not on Central, so Maven cannot read it as a dependency; ``dependency:unpack``
of the artifact by its coordinates needs no descriptor, and unpacks it into the same output directory as the
(empty) dependency copy.
"""
from __future__ import annotations

from pathlib import Path

from ..broker.jars import MARKER, cache_root, resolve_maven_jars
from ..errors import RegistryError

ARTIFACT = "io.apicurio:apicurio-registry-app:{version}:tar.gz:all"
# A packaging pom with nothing to copy: the goal that runs is the dependency:unpack added on the command line.
EMPTY_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.streamrft</groupId>
  <artifactId>embedded-schema-registry</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
</project>
"""


def registry_home(version: str) -> Path:
    return cache_root() / f"apicurio-registry-{version}"


def registry_ready(version: str) -> bool:
    return (registry_home(version) / MARKER).exists()


def ensure_registry(version: str = "3.0.9", quiet: bool = False) -> Path:
    """The registry's runner jar, resolving the distribution first if it is not cached yet."""
    lib = resolve_maven_jars(
        registry_home(version), EMPTY_POM, f"Apicurio Registry {version}",
        setup_hint="`streamrft registry setup`, or point schema_registry.url at a running registry",
        extra_args=("dependency:unpack", f"-Dartifact={ARTIFACT.format(version=version)}"), quiet=quiet)
    runner = lib / f"apicurio-registry-app-{version}-runner.jar"
    if not runner.exists():
        raise RegistryError(f"{runner} is missing from the resolved distribution; delete {lib.parent} and run "
                            "`streamrft registry setup` again")
    return runner
