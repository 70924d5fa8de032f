"""Kafka's own command-line tools (the ``kafka-tools`` artifact: ``kafka-consumer-groups``' ConsumerGroupCommand,
GetOffsetShell, TransactionsCommand, ...) for a machine without a Kafka distribution: resolved from Maven like the
broker's jars, into a cache of their own (``kafka-tools-<version>/lib``), so the broker's classpath stays as it
is. Operators run them with ``java -cp``; the tests use them as clients none of us wrote.

``python -m streamrft.broker.tools`` resolves them (once) and prints the ``lib`` directory, for
``java -cp "$(python -m streamrft.broker.tools)/*" org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ...``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .jars import _VERSION_RE, cache_root, find_java, resolve_maven_jars
from ..errors import BrokerError

CONSUMER_GROUPS = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
DEFAULT_VERSION = "4.1.1"

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<!-- Resolves Apache Kafka's command-line tools; written by streamrft.broker.tools, never built itself. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.streamrft</groupId>
  <artifactId>kafka-tools</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka-tools</artifactId>
      <version>@KAFKA_VERSION@</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-nop</artifactId>
      <version>2.0.17</version>
    </dependency>
  </dependencies>
</project>
"""


def tools_home(version: str) -> Path:
    return cache_root() / f"kafka-tools-{version}"


def ensure_tools(version: str = DEFAULT_VERSION, quiet: bool = False) -> Path:
    """``kafka-tools-<version>/lib``, resolving the jars with Maven first if they are not cached yet."""
    if not _VERSION_RE.match(version):
        raise BrokerError(f"Kafka version {version!r} is not a version number such as 4.1.1")
    return resolve_maven_jars(tools_home(version), _POM.replace("@KAFKA_VERSION@", version),
                              f"Apache Kafka {version} tools",
                              setup_hint="`python -m streamrft.broker.tools` (scripts/setup.sh does)", quiet=quiet)


def tool_command(main_class: str, *args: str, version: str = DEFAULT_VERSION) -> list[str]:
    """The command line that runs one of Kafka's tools (``main_class``) with ``args``."""
    return [find_java().path, "-cp", f"{ensure_tools(version, quiet=True)}/*", main_class, *args]


if __name__ == "__main__":
    print(ensure_tools(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VERSION, quiet=True))
