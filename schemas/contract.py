"""The Avro contract: loads the ``.avsc`` files shipped in this folder into self-contained schemas.

Records reference shared named types (``io.streamrft.Task``, ``io.streamrft.RolloutKind``) defined in their own
files; fastavro's ``load_schema_ordered`` injects those definitions so every schema below is complete on its own,
which is what the parsing canonical form (and so the fingerprint) must be computed over.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from fastavro.schema import fingerprint, load_schema_ordered, parse_schema, to_parsing_canonical_form

from .records import RECORD_TYPES

SCHEMA_DIR = Path(__file__).parent

PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
COMPLEX = {"record", "enum", "fixed", "array", "map"}  # the "type" of a schema written as an object


def _named_types(node, defined: set[str], used: set[str]) -> None:
    """The named types a schema defines and those it refers to by name (short names, namespace dropped)."""
    if isinstance(node, str):
        if node not in PRIMITIVES:
            used.add(node.rsplit(".", 1)[-1])
    elif isinstance(node, list):
        for item in node:
            _named_types(item, defined, used)
    elif isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "enum", "fixed") and "name" in node:
            defined.add(node["name"].rsplit(".", 1)[-1])
        if not (isinstance(kind, str) and kind in COMPLEX):
            _named_types(kind, defined, used)  # a field's type, or a type named inside a union
        for key in ("items", "values", "fields"):
            if key in node:
                _named_types(node[key], defined, used)


def sources_of(name: str, schema_dir: Path = SCHEMA_DIR) -> tuple[str, ...]:
    """The ``.avsc`` files record ``name`` is built from, dependencies first: each named type a file refers to
    but does not define lives in a file of its own name (``io.streamrft.Task`` in ``Task.avsc``)."""
    order: list[str] = []

    def visit(current: str, path: tuple[str, ...]) -> None:
        if current in order:
            return
        if current in path:
            raise ValueError(f"schemas refer to each other in a cycle: {' -> '.join((*path, current))}")
        defined: set[str] = set()
        used: set[str] = set()
        _named_types(json.loads((schema_dir / f"{current}.avsc").read_text()), defined, used)
        for dependency in sorted(used - defined):
            visit(dependency, (*path, current))
        order.append(current)

    visit(name, ())
    return tuple(order)


# The record names come from the one list of record types (schemas/records.py); the files each is built from
# follow from the .avsc files themselves.
RECORD_NAMES: tuple[str, ...] = tuple(RECORD_TYPES)
# Earlier versions of the schemas, ``previous/<Record>.<n>.avsc``: records on a topic written before a field was
# added keep decoding (fastavro resolves them against the current schema, with the new field's default). A
# schema that gains a field leaves its old file here.
PREVIOUS_DIR = SCHEMA_DIR / "previous"


def previous_schemas() -> list[tuple[str, dict]]:
    """(record name, schema) of every earlier schema version shipped in ``previous/``."""
    out = []
    for path in sorted(PREVIOUS_DIR.glob("*.avsc")):
        name = path.name.split(".")[0]
        deps = [str(SCHEMA_DIR / f"{part}.avsc") for part in sources_of(name)[:-1]]
        out.append((name, load_schema_ordered([*deps, str(path)], _write_hint=False)))
    return out


@cache
def schema_json(name: str) -> dict:
    """The complete (dependencies injected) schema of record ``name`` as a JSON-compatible dict."""
    files = [str(SCHEMA_DIR / f"{part}.avsc") for part in sources_of(name)]
    return load_schema_ordered(files, _write_hint=False)


def canonical_form(schema: dict | str) -> str:
    """Avro parsing canonical form (the input of the fingerprint)."""
    return to_parsing_canonical_form(schema)


def fingerprint64(schema: dict | str) -> bytes:
    """CRC-64-AVRO fingerprint of a schema as the 8 bytes that go on the wire (little-endian, per the spec)."""
    return bytes.fromhex(fingerprint(canonical_form(schema), "CRC-64-AVRO"))


def parsed(schema: dict) -> dict:
    """fastavro's parsed form of a complete schema; each call gets its own named-type table.

    ``logicalType`` annotations are dropped: they do not change the binary encoding (nor the canonical form, so
    not the fingerprint), and without them fastavro hands timestamps over as the integer milliseconds the records
    hold instead of building datetime objects for every record."""
    return parse_schema(_without_logical_types(schema), named_schemas={}, _write_hint=False)


def _without_logical_types(node):
    if isinstance(node, dict):
        return {k: _without_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [_without_logical_types(v) for v in node]
    return node
