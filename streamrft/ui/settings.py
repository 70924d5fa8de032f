"""What ``streamrft ui`` is told on its command line, checked at start with messages that say how to fix it."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from . import DEFAULT_PORT


class UiSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", min_length=1,
                      description="address to bind; loopback by default, the UI has no authentication")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port; 0 picks a free one")
    sample_s: float = Field(5.0, ge=0.2, le=3600.0, description="seconds between two samples of the groups' lag")
    history: int = Field(720, ge=2, le=100_000, description="lag samples kept per group and topic (in memory)")
    records: int = Field(50, ge=1, le=1000, description="records shown per topic page, newest last")
    scan: int = Field(5000, ge=1, le=1_000_000,
                      description="offsets read back from the end of each partition when searching by key")


OPTIONS = {"sample_s": "--sample-s", "history": "--history", "records": "--records", "scan": "--scan",
           "port": "--port", "host": "--host"}


def settings_from(**given) -> UiSettings:
    """The settings of the options given (None: the default); ConfigError naming the option otherwise."""
    try:
        return UiSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        lines = ["invalid option of streamrft ui:"]
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            lines.append(f"  {OPTIONS.get(name, name)} = {err.get('input')!r}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None
