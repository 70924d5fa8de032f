"""The embedded schema registry (``schema_registry.url: embedded``): Apicurio Registry on loopback, speaking the
Confluent schema-registry API, resolved from Maven Central and started like the embedded broker."""
from __future__ import annotations

from .artifact import ensure_registry, registry_ready
from .server import EmbeddedRegistry

__all__ = ["EmbeddedRegistry", "ensure_registry", "registry_ready"]
