"""The run's secrets on Kubernetes: never in the ConfigMap, each role's from its own Secret.

Every ``SecretStr`` field of the run config (found by walking the model, so a new one is covered without a
change here) is a secret: a config file that sets one is refused, since the file becomes a ConfigMap anyone
with read access to the namespace can read. A role gets the secrets of the sections it reads as
``STREAMRFT_<SECTION>__<KEY>`` variables from a ``secretKeyRef`` into its own Secret (optional keys: a run
without an S3 store has no S3 key), so a compromised rollout worker cannot read the trainer's credentials.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

from pydantic import BaseModel, SecretBytes, SecretStr

from ..config import RunConfig
from ..config.environment import ENV_PREFIX, NESTED_DELIMITER

Path = tuple[str, ...]
# the config sections each deployed role reads a secret from (kafka and the registry: every role)
_SECTIONS = {"explorer": ("explorer",),
             "rollout": ("rollout", "auxiliary_models", "trainer.weights"),  # workers load published weights
             "trainer": ("trainer",),
             "monitor": ("monitor",),
             "serve": ("serve", "auxiliary_models")}
_COMMON = ("kafka", "schema_registry")


def secret_fields(config: RunConfig) -> list[Path]:
    """The dotted path of every secret field of ``config``, set or not (entries of mappings included)."""
    return list(_walk(config, ()))


def _walk(model: BaseModel, prefix: Path) -> Iterator[Path]:
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if _is_secret_type(field.annotation):
            yield prefix + (name,)
        elif isinstance(value, BaseModel):
            yield from _walk(value, prefix + (name,))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, BaseModel):
                    yield from _walk(item, prefix + (name, str(key)))


def _is_secret_type(annotation: Any) -> bool:
    return annotation in (SecretStr, SecretBytes) or any(_is_secret_type(arg) for arg in get_args(annotation))


def env_name(path: Path) -> str:
    """``("trainer", "weights", "s3", "secret_access_key")`` -> ``STREAMRFT_TRAINER__WEIGHTS__S3__SECRET_ACCESS_KEY``."""
    return ENV_PREFIX + NESTED_DELIMITER.join(path).upper()


def set_secrets(config: RunConfig) -> list[Path]:
    """The secret fields ``config`` gives a value."""
    return [path for path in secret_fields(config) if _value(config, path) is not None]


def _value(config: RunConfig, path: Path) -> Any:
    value: Any = config
    for part in path:
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def secret_problems(config: RunConfig, role_secret: str) -> list[str]:
    """What to change for each secret the config file holds (its name, never its value)."""
    return [f"{'.'.join(path)}: the config file holds a secret, and the file becomes a ConfigMap; remove it "
            f"and put it in each role's own Secret ({role_secret}) under the key {env_name(path)}"
            for path in set_secrets(config)]


def role_secret_env(config: RunConfig, role: str, secret: str, *, skip: frozenset[str] = frozenset()) -> list[dict]:
    """``role``'s secret variables, each from key ``STREAMRFT_...`` of its own Secret ``secret``; ``skip``: the
    variables that come from elsewhere (the role's KafkaUser password)."""
    sections = _COMMON + _SECTIONS.get(role, (role,))
    names = [env_name(path) for path in secret_fields(config)
             if any(".".join(path).startswith(section + ".") for section in sections)]
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name, "optional": True}}}
            for name in names if name not in skip]

