"""docs/reference/configuration.md: every key of the run configuration (key, type, default, description,
environment variable), one table per section, generated from the pydantic models (:mod:`.config_keys`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretBytes, SecretStr

from streamrft.config.environment import ENV_PREFIX, NONE_VALUE

from .config_keys import LIST_ITEM, MAPPING_KEY, UNSET, ConfigKey, ConfigSection, sections
from .markdown_cells import code, docstring, generated_notice, table, text, value

PATH = "docs/reference/configuration.md"
HIDDEN = "(hidden)"  # the default of a secret key, which the page never shows
HEADER = ("key", "type", "default", "description", "environment variable")

_INTRO = f"""\
# Configuration reference

A run is configured by one YAML file (`streamrft run RUN.yaml`; `examples/` has some), by environment variables, and
by a command's own options, each overriding the one before. A file names only what it changes: every key has a
default but the few marked "required", which an item of a list, an entry of a mapping or an optional section must
give when it is there. A key that is not here is an error that names it, as is a value out of its range.

**Environment variables.** `{ENV_PREFIX}<SECTION>__<KEY>` sets a key (`{ENV_PREFIX}TRAINER__WEIGHTS__URL` is
`trainer.weights.url`); names are matched without regard to case. A scalar key takes the value as it is (`12`,
`true`, a password that looks like a number stays a string); a list, a mapping or a whole section takes JSON
(`{ENV_PREFIX}KAFKA__PRODUCER='{{"linger.ms": 5}}'`), and `{NONE_VALUE}` is null. A key inside a list (`[]` below,
such as `explorer.tasksets[].weight`) cannot be set from the environment on its own: its list's variable sets the
whole list, as JSON. A key under a mapping (`auxiliary_models.<name>`) takes the entry's name in place of `<NAME>`.
Secrets (`SecretStr` keys: passwords, API keys, the weight-sync group secret) belong in the environment, not in a
file; their values are never shown, here or in an error.
"""


def render(model: type[BaseModel] | None = None) -> str:
    """The page of ``model`` (default: the run config), the same for the same models."""
    all_sections = sections(model)
    parts = [generated_notice("the models of streamrft/config/ and streamrft/engines/settings/"), _INTRO]
    first_of: dict[type, ConfigSection] = {}
    for section in all_sections:
        parts.append(_section(section, first_of.setdefault(section.model, section)))
    return "\n".join(parts).rstrip("\n") + "\n"


def anchor(path: str) -> str:
    """The heading id of a section (``trainer.weights.s3`` -> ``trainer-weights-s3``; the top level ``top-level``),
    set explicitly so that other pages can link to it whatever MkDocs' slugs do with dots."""
    if not path:
        return "top-level"
    plain = path.replace(LIST_ITEM, "").replace("." + MAPPING_KEY, "")
    return plain.replace(".", "-").replace("_", "-")


def _section(section: ConfigSection, first: ConfigSection) -> str:
    """A section's heading, what its model's docstring says of it (once per model: the topics share one) and its
    table."""
    level = "#" * min(2 + max(section.depth - 1, 0), 6)
    title = code(section.path) if section.path else "Top level"
    lines = [f"{level} {title} {{ #{anchor(section.path)} }}", ""]
    about = docstring(section.model) if first is section else (
        f"The keys of [{code(first.path)}](#{anchor(first.path)}), with this section's defaults.")
    if about:
        lines += [about, ""]
    if section.keys and section.keys[0].list_env is not None and section.path.endswith(LIST_ITEM):
        lines += [f"Each item of the list; set from the environment only as part of {code(section.keys[0].list_env)}"
                  " (JSON).", ""]
    lines += [table(HEADER, [_row(key) for key in section.keys]), ""]
    return "\n".join(lines)


def _row(key: ConfigKey) -> tuple[str, ...]:
    shown = code(key.path)
    if key.section is not None:
        shown = f"[{shown}](#{anchor(key.section.path)})"
    return (shown, text(type_name(key.field.annotation, key.field.metadata)), _default(key),
            text(key.field.description or ""), _variable(key))


def _variable(key: ConfigKey) -> str:
    if key.env is not None:
        return code(key.env)
    return f"only in {code(key.list_env or '')}"


def _default(key: ConfigKey) -> str:
    if key.default is UNSET:
        return "required"
    if key.secret and key.default not in (None, ""):
        return HIDDEN
    if isinstance(key.default, BaseModel):  # a section: its keys' defaults are in its own table
        return "below"
    return code(value(key.default))


_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", SecretStr: "secret string",
          SecretBytes: "secret bytes", type(None): "null", Any: "any"}


def type_name(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """What a key takes, in words, with its range: ``integer, ≥ 1``, ``one of `drain`, `in_flight```, ``list of
    section``, ``number or null``."""
    words = _type_words(annotation)
    bounds = [_bound(item) for item in metadata]
    return ", ".join([words] + [b for b in bounds if b])


def _type_words(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation in _NAMES:
        return _NAMES[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if origin is Literal:
        return "one of " + ", ".join(f"`{arg}`" for arg in args)
    if origin in (tuple, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return f"list of {_type_words(args[0])}"
        return "[" + ", ".join(_type_words(arg) for arg in args) + "]"
    if origin is dict:
        return f"mapping of {_type_words(args[0])} to {_type_words(args[1])}"
    if args:  # a union: X | Y | None
        named = [_type_words(arg) for arg in args if arg is not type(None)]
        members = " or ".join(dict.fromkeys(named))
        return f"{members} or null" if type(None) in args else members
    return getattr(annotation, "__name__", str(annotation))


def _bound(item: Any) -> str:
    if isinstance(item, annotated_types.Ge):
        return f"≥ {item.ge}"
    if isinstance(item, annotated_types.Gt):
        return f"> {item.gt}"
    if isinstance(item, annotated_types.Le):
        return f"≤ {item.le}"
    if isinstance(item, annotated_types.Lt):
        return f"< {item.lt}"
    if isinstance(item, annotated_types.MinLen):
        return f"at least {item.min_length} long"
    if isinstance(item, annotated_types.MaxLen):
        return f"at most {item.max_length} long"
    pattern = getattr(item, "pattern", None)
    return f"matching `{pattern}`" if pattern else ""
