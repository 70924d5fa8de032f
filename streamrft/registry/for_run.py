"""``schema_registry.url: embedded`` for a run: the registry `streamrft run` starts beside the broker, and the
run's config pointed at it (the roles get its address in their environment)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from rich.console import Console

if TYPE_CHECKING:
    from ..config import RunConfig

REGISTRY_URL_ENV = "STREAMRFT_SCHEMA_REGISTRY__URL"


@contextmanager
def registry_for(config: "RunConfig", console: Console | None = None) -> Iterator["RunConfig"]:
    """``config`` itself when its registry is not ``embedded``; otherwise a started registry's config, stopped
    at exit. Its schemas are kept in the run's directory: a --resume reads records by the ids they were written
    with."""
    if not config.schema_registry.embedded:
        yield config
        return
    from .server import EmbeddedRegistry

    console = console or Console(stderr=True)
    registry = EmbeddedRegistry(config.schema_registry, data_dir=config.output_dir / "schema-registry")
    with console.status(f"starting the embedded schema registry (Apicurio {config.schema_registry.embedded_version})"):
        registry.start()
    try:
        console.print(f"schema registry up at {registry.url} in {registry.startup_s:.1f} s (compatibility "
                      f"{config.schema_registry.compatibility}, schemas in {registry.data_dir})")
        section = config.schema_registry.model_copy(update={"url": registry.url})
        yield config.model_copy(update={"schema_registry": section})
    finally:
        registry.stop()
