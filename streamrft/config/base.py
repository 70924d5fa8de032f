"""Shared base of the config models: frozen, typo-proof, and errors that say how to fix them without ever
showing a secret."""
from __future__ import annotations

from collections.abc import Iterator
from difflib import get_close_matches
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, SecretBytes, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from streamrft.errors import ConfigError

# A key whose name says it holds a secret keeps its value out of error messages even when it is no SecretStr
# field, e.g. a librdkafka ``sasl.password`` passed through ``kafka.producer``.
SECRET_WORDS = ("password", "secret", "token", "credential", "user_info", "private_key", "api_key")
SHOWN_TYPES = (str, int, float, bool, type(None))


class Section(BaseModel):
    """One component's configuration. Frozen (derived values are properties) and unknown keys are errors,
    so a misspelt key fails at start instead of silently falling back to a default."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def explain(exc: ValidationError, source: str, model: type[BaseModel]) -> ConfigError:
    """Turn pydantic's report into one line per problem: the dotted key, the value given and the fix.

    The value is shown only when it is a scalar and not a secret (see :func:`is_secret`), so neither a password
    of the wrong type nor a section holding one is echoed into logs.
    """
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(part) for part in loc) or "(top level)"
        value = err.get("input")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key; check its spelling against docs/reference/configuration.md"
        elif err["type"] == "missing":
            message = "required key is missing; add it"
        hidden = err["type"] == "missing" or not isinstance(value, SHOWN_TYPES) or is_secret(model, loc)
        shown = "" if hidden else f" = {value!r}"
        lines.append(f"  {key}{shown}: {message}")
    return ConfigError("\n".join(lines))


def is_secret(model: type[BaseModel], loc: tuple[str | int, ...]) -> bool:
    """Whether the value at ``loc`` (a pydantic error location under ``model``) is or lies in a secret: a
    ``SecretStr``/``SecretBytes`` field, an unknown key that looks like a misspelling of one (``sasl_pasword``),
    or a key whose name contains one of ``SECRET_WORDS``."""
    models: list[type[BaseModel]] = [model]
    for part in loc:
        if isinstance(part, str) and any(word in part.lower() for word in SECRET_WORDS):
            return True
        field = _field(models, part)
        if field is None:
            if isinstance(part, str) and get_close_matches(part, _secret_names(models), n=1, cutoff=0.75):
                return True
            continue  # a list index, a mapping key or a union member's tag: still inside the same field
        if _holds_secret(field):
            return True
        models = [t for t in _types_in(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return False


def _field(models: list[type[BaseModel]], part: str | int) -> FieldInfo | None:
    for candidate in models:
        for name, field in candidate.model_fields.items():
            if part in (name, field.alias):
                return field
    return None


def _holds_secret(field: FieldInfo) -> bool:
    return any(t in (SecretStr, SecretBytes) for t in _types_in(field.annotation))


def _secret_names(models: list[type[BaseModel]]) -> list[str]:
    return [name for candidate in models for name, field in candidate.model_fields.items() if _holds_secret(field)]


def _types_in(annotation: Any) -> Iterator[Any]:
    """The annotation and every type nested in it (``tuple[TaskFile, ...]``, ``SecretStr | None``, ...)."""
    yield annotation
    for arg in get_args(annotation):
        yield from _types_in(arg)
