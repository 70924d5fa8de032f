"""What the contract publishes for each record type, for writers in any language (``streamrft schemas``): the
self-contained schema (named types of other ``.avsc`` files inlined), its Parsing Canonical Form, its CRC-64-AVRO
fingerprint and the single-object header a payload of it starts with.

Byte order: ``fingerprint_hex`` is the fingerprint as a 64-bit number, most significant digit first (what Java's
``SchemaNormalization.parsingFingerprint64`` returns, printed in hex); on the wire the single-object header is
``C3 01`` followed by those 8 bytes little-endian (``header_hex``).
"""
from __future__ import annotations

from .codec import SINGLE_OBJECT_MAGIC
from .contract import RECORD_NAMES, canonical_form, fingerprint64, schema_json


def published(name: str) -> dict:
    """``{"schema", "canonical_form", "fingerprint_hex", "fingerprint_int64", "header_hex"}`` of record ``name``.
    ``fingerprint_int64``: the same number as a signed 64-bit integer (Java's ``long``)."""
    schema = schema_json(name)
    wire = fingerprint64(schema)
    return {
        "schema": schema,
        "canonical_form": canonical_form(schema),
        "fingerprint_hex": f"{int.from_bytes(wire, 'little'):016x}",
        "fingerprint_int64": int.from_bytes(wire, "little", signed=True),
        "header_hex": (SINGLE_OBJECT_MAGIC + wire).hex(),
    }


def contract() -> dict[str, dict]:
    """:func:`published` of every record type, by name, in the order of ``RECORD_TYPES``."""
    return {name: published(name) for name in RECORD_NAMES}
