"""Every key of the run configuration, found by walking :class:`~streamrft.config.run.RunConfig` through its nested
models (sections, lists of sections, mappings of named sections), with what the reference says of each: its dotted
key, its field, its default in place, and the environment variable that sets it
(:mod:`streamrft.config.environment`). The configuration page and its tests read this one walk."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, get_args, get_origin

from pydantic import BaseModel, SecretBytes, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from streamrft.config.base import SECRET_WORDS
from streamrft.config.environment import ENV_PREFIX, NESTED_DELIMITER

LIST_ITEM = "[]"  # the path part of a list's items: explorer.eval_tasksets[].name
MAPPING_KEY = "<name>"  # the path part of a mapping's keys: auxiliary_models.<name>.engine
UNSET = object()  # a default that no value stands for (a required key)


@dataclass(frozen=True)
class ConfigKey:
    path: str  # dotted, as written in YAML
    name: str  # the last part: the field's alias or name
    field: FieldInfo
    default: Any  # in place (topics.rollouts.partitions is 16, not TopicConfig's 1); UNSET when required
    env: str | None  # the variable that sets it; None inside a list, which only its list's variable sets
    list_env: str | None  # inside a list: the variable of that list (JSON)
    section: "ConfigSection | None" = None  # the section it opens, for a key whose value is one

    @property
    def secret(self) -> bool:
        """A value to keep off the page: a SecretStr, or a string key whose name says it holds a secret
        (``max_tokens`` says ``token`` too, but holds no string)."""
        types = set(_types_in(self.field.annotation))
        if types & {SecretStr, SecretBytes}:
            return True
        named = any(word in self.name.lower() for word in SECRET_WORDS)
        return named and str in types


@dataclass(frozen=True)
class ConfigSection:
    path: str  # "" for the top level
    model: type[BaseModel]
    keys: list[ConfigKey] = field(default_factory=list)
    depth: int = 0


def sections(model: type[BaseModel] | None = None) -> list[ConfigSection]:
    """The run config's sections, the top level first, each followed by the sections nested in it."""
    if model is None:
        from streamrft.config.run import RunConfig

        model = RunConfig
    out: list[ConfigSection] = []
    _walk(model, "", _defaults_of(model), (), None, 0, out)
    return out


def keys(model: type[BaseModel] | None = None) -> Iterator[ConfigKey]:
    """Every key, sections included, in page order."""
    for section in sections(model):
        yield from section.keys


def _walk(model: type[BaseModel], path: str, defaults: dict[str, Any], env_parts: tuple[str, ...] | None,
          list_env: str | None, depth: int, out: list[ConfigSection]) -> ConfigSection:
    section = ConfigSection(path, model, depth=depth)
    out.append(section)
    for name, info in model.model_fields.items():
        shown = info.alias or name
        key_path = f"{path}.{shown}" if path else shown
        key_env = None if env_parts is None else _variable(*env_parts, shown)
        nested = _section_model(info.annotation)
        sub = None
        if nested is not None:
            container = _container(info.annotation)
            sub_path = key_path + {"list": LIST_ITEM, "mapping": "." + MAPPING_KEY}.get(container, "")
            sub_parts = (None if env_parts is None or container == "list" else
                         (*env_parts, shown, *([MAPPING_KEY] if container == "mapping" else [])))
            sub_list_env = list_env or (key_env if container == "list" else None)
            own = defaults.get(name)
            sub_defaults = (_defaults_of(nested, own if isinstance(own, BaseModel) else None))
            sub = _walk(nested, sub_path, sub_defaults, sub_parts, sub_list_env, depth + 1, out)
        section.keys.append(ConfigKey(key_path, shown, info, defaults.get(name, UNSET), key_env, list_env, sub))
    return section


def _variable(*parts: str) -> str:
    return ENV_PREFIX + NESTED_DELIMITER.join(part.upper() for part in parts)


def _defaults_of(model: type[BaseModel], instance: BaseModel | None = None) -> dict[str, Any]:
    """Each field's default: the value in ``instance`` (a section's default in its parent) when given, else the
    field's own (its factory called)."""
    out = {}
    for name, info in model.model_fields.items():
        if instance is not None:
            out[name] = getattr(instance, name)
        elif info.default_factory is not None:
            out[name] = info.default_factory()  # type: ignore[call-arg]  # no factory here takes the data
        elif info.default is not PydanticUndefined:
            out[name] = info.default
    return out


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a key's value is, or holds (in a list, a mapping or an optional), else None."""
    for candidate in _types_in(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _container(annotation: Any) -> str:
    """How a section-valued key holds its section: ``list``, ``mapping`` or ``single`` (maybe null)."""
    for candidate in _types_in(annotation):
        origin = get_origin(candidate)
        if origin in (tuple, list):
            return "list"
        if origin is dict:
            return "mapping"
    return "single"


def _types_in(annotation: Any) -> Iterator[Any]:
    yield annotation
    for arg in get_args(annotation):
        yield from _types_in(arg)
