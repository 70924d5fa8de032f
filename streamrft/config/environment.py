"""Environment overrides, ``STREAMRFT_<SECTION>__<KEY>=value``, read by pydantic-settings.

pydantic-settings decides from each target field how to read a value: a scalar field gets the string as it is
(pydantic converts ``"12"`` to an int, ``"true"`` to a bool; a ``SecretStr`` keeps ``"123456"`` as the string it
is), a list, mapping or model field takes JSON. ``null`` means None. Nothing is YAML-parsed, so a numeric
password is never turned into a number (whose type error would then echo it).

Only variables whose first segment names a field of the run config are read, so process settings such as
``STREAMRFT_LOG_LEVEL`` or ``STREAMRFT_CACHE_DIR`` stay the CLI's own. Under a known section every key is
passed on, so a misspelt one fails validation with its dotted name.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_settings import EnvSettingsSource, SettingsError
from pydantic_settings.sources.types import EnvNoneType

from streamrft.errors import ConfigError

ENV_PREFIX = "STREAMRFT_"
NESTED_DELIMITER = "__"
NONE_VALUE = "null"


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping rather than ``os.environ``, so callers (tests,
    the launcher building a child's environment) say which environment they mean."""

    def __init__(self, model: type[BaseModel], env: Mapping[str, str]) -> None:
        self._env = env
        super().__init__(
            model,  # type: ignore[arg-type]  # the source only reads model_fields and model_config
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_prefix_target="all",  # STREAMRFT_TOPIC_PREFIX reaches the aliased field too
            env_nested_delimiter=NESTED_DELIMITER,
            env_parse_none_str=NONE_VALUE,
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # the hook DotEnvSettingsSource overrides too; names are matched case-insensitively, "null" is None
        return {name.lower(): EnvNoneType(value) if value == NONE_VALUE else value for name, value in self._env.items()}


def read_environment(env: Mapping[str, str], model: type[BaseModel]) -> dict[str, Any]:
    """``STREAMRFT_KAFKA__BOOTSTRAP_SERVERS=host:9092`` -> ``{"kafka": {"bootstrap_servers": "host:9092"}}``.

    Values stay strings unless their field is a list, mapping or model (JSON then); validation happens once, on
    the merged config, so an error names the key however it was set.
    """
    try:
        return _MappingEnvSource(model, env)()
    except SettingsError as exc:
        # the message names the section, never the value (which may hold a secret)
        raise ConfigError(f"environment overrides: {exc}; values of list, mapping or section keys must be JSON "
                          f"(e.g. {ENV_PREFIX}KAFKA__PRODUCER='{{\"linger.ms\": 5}}')") from None
