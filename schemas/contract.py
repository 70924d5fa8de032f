"""The Avro contract: loads the ``.avsc`` files shipped in this folder into self-contained schemas.

Records reference shared named types (``io.streamrft.Task``, ``io.streamrft.RolloutKind``) defined in their own
files; fastavro's ``load_schema_ordered`` injects those definitions so every schema below is complete on its own,
which is what the parsing canonical form (and so the fingerprint) must be computed over.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

from fastavro.schema import fingerprint, load_schema_ordered, parse_schema, to_parsing_canonical_form

SCHEMA_DIR = Path(__file__).parent

# record name -> the files it is built from, dependencies first
_SOURCES: dict[str, tuple[str, ...]] = {
    "Task": ("Task",),
    "RolloutRequest": ("RolloutKind", "Task", "RolloutRequest"),
    "Experience": ("RolloutKind", "Experience"),
    "RolloutResult": ("RolloutKind", "RolloutResult"),
    "SyncSignal": ("SyncSignal",),
    "Metric": ("Metric",),
}

RECORD_NAMES: tuple[str, ...] = tuple(_SOURCES)
# Earlier versions of the schemas, ``previous/<Record>.<n>.avsc``: records on a topic written before a field was
# added keep decoding (fastavro resolves them against the current schema, with the new field's default). A
# schema that gains a field leaves its old file here.
PREVIOUS_DIR = SCHEMA_DIR / "previous"


def previous_schemas() -> list[tuple[str, dict]]:
    """(record name, schema) of every earlier schema version shipped in ``previous/``."""
    out = []
    for path in sorted(PREVIOUS_DIR.glob("*.avsc")):
        name = path.name.split(".")[0]
        deps = [str(SCHEMA_DIR / f"{part}.avsc") for part in _SOURCES[name][:-1]]
        out.append((name, load_schema_ordered([*deps, str(path)], _write_hint=False)))
    return out


@cache
def schema_json(name: str) -> dict:
    """The complete (dependencies injected) schema of record ``name`` as a JSON-compatible dict."""
    files = [str(SCHEMA_DIR / f"{part}.avsc") for part in _SOURCES[name]]
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
