"""Shared base of the config models: frozen, typo-proof, and errors that say how to fix them."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ConfigError


class Section(BaseModel):
    """One component's configuration. Frozen (derived values are properties) and unknown keys are errors,
    so a misspelt key fails at start instead of silently falling back to a default."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def explain(exc: ValidationError, source: str) -> ConfigError:
    """Turn pydantic's report into one line per problem: the dotted key, the value given and the fix."""
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(top level)"
        value = err.get("input")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key; check its spelling against the configuration reference in README.md"
        elif err["type"] == "missing":
            message = "required key is missing; add it"
        shown = "" if err["type"] in ("missing",) or isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {key}{shown}: {message}")
    return ConfigError("\n".join(lines))
