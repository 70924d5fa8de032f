"""The steps of Avro's Parsing Canonical Form that other libraries are known to skip, and the fingerprints a
schema gets when one is skipped: so a payload whose fingerprint is unknown can be told apart from an unknown
schema, and its dead letter can say which step its writer's library missed.

The spec's form (``contract.canonical_form``, fastavro's) keeps only ``name``, ``type``, ``fields``, ``symbols``,
``items``, ``values`` and ``size``, in that order, writes a primitive as its bare name and every named type by its
full name. Apache Avro (Java) computes exactly that (``SchemaNormalization.parsingFingerprint64``). A library that
keeps ``logicalType`` on a primitive, keeps a primitive in its object form, or writes short names computes a
fingerprint that no reader following the spec knows.
"""
from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass

from fastavro.schema import fingerprint

PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


@dataclass(frozen=True)
class Rule:
    """One step of the canonical form: ``key`` names it in code, ``says`` in a message."""

    key: str
    says: str


LOGICAL_TYPE = Rule("logical-type", 'drops logicalType ({"type":"long","logicalType":"timestamp-millis"} becomes "long")')
PRIMITIVE_OBJECT = Rule("primitive-object", 'writes a primitive by its bare name ({"type":"long"} becomes "long")')
FULL_NAMES = Rule("full-names", 'names every named type by its full name ("io.streamrft.Task", not "Task")')
RULES = (LOGICAL_TYPE, PRIMITIVE_OBJECT, FULL_NAMES)
# Not a step of the form: the right fingerprint with its 8 bytes in the other order
BYTE_ORDER = Rule("byte-order", "puts the fingerprint's 8 bytes on the wire little-endian, least significant first")
# What each rule's skip is known from (as seen in practice; other versions of these libraries may differ)
KNOWN_SKIPPERS = {LOGICAL_TYPE: "hamba/avro", PRIMITIVE_OBJECT: "goavro"}


def canonical(schema, skipped: frozenset[Rule] = frozenset()) -> str:
    """The Parsing Canonical Form of a complete ``schema`` (a parsed JSON value), computed without the steps
    in ``skipped`` (none: the spec's form)."""
    return json.dumps(_form(schema, "", set(), skipped), separators=(",", ":"), ensure_ascii=False)


def crc64_avro(text: str) -> bytes:
    """The CRC-64-AVRO fingerprint of ``text`` as its 8 wire bytes (little-endian)."""
    return bytes.fromhex(fingerprint(text, "CRC-64-AVRO"))


def skip_fingerprints(schema) -> dict[bytes, frozenset[Rule]]:
    """Wire fingerprint -> the steps skipped to get it, for every non-empty combination of :data:`RULES`
    that changes ``schema``'s form. Computed once per schema: a flood of bad records asks for it each time."""
    return _skip_table(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _skip_table(schema_json: str) -> dict[bytes, frozenset[Rule]]:
    schema = json.loads(schema_json)
    spec = canonical(schema)
    out: dict[bytes, frozenset[Rule]] = {}
    for size in range(1, len(RULES) + 1):
        for combination in itertools.combinations(RULES, size):
            skipped = frozenset(combination)
            form = canonical(schema, skipped)
            if form != spec:
                out.setdefault(crc64_avro(form), skipped)
    return out


def describe_skips(skipped: frozenset[Rule]) -> str:
    """What a writer that skipped these steps missed, and which libraries are known to."""
    if BYTE_ORDER in skipped:
        return f"it was written big-endian; the single-object header {BYTE_ORDER.says}"
    steps = "; ".join(f"the canonical form {rule.says}" for rule in RULES if rule in skipped)
    who = sorted({KNOWN_SKIPPERS[rule] for rule in skipped if rule in KNOWN_SKIPPERS})
    if not who:
        return steps
    return steps + f" ({' and '.join(who)} {'computes' if len(who) == 1 else 'compute'} fingerprints without it)"


def match_skips(fp: bytes, schemas) -> tuple[str, frozenset[Rule]] | None:
    """(record name, steps skipped) when ``fp`` is one of ``schemas``' fingerprints (``(name, schema)`` pairs)
    computed without some steps of the canonical form, or in the wrong byte order (:data:`BYTE_ORDER`); None when
    it is none of them."""
    for name, schema in schemas:
        if crc64_avro(canonical(schema)) == fp[::-1]:
            return name, frozenset({BYTE_ORDER})
        skipped = skip_fingerprints(schema).get(fp)
        if skipped is not None:
            return name, skipped
    return None


def _qualify(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _short(name: str) -> str:
    return name.rpartition(".")[2]


def _form(node, namespace: str, seen: set[str], skipped: frozenset[Rule]):
    """The canonical value of ``node`` (``seen``: full names already defined, written by name after that)."""
    names = FULL_NAMES not in skipped
    if isinstance(node, str):
        if node in PRIMITIVES:
            return node
        full = _qualify(node, namespace)
        return full if names else _short(full)
    if isinstance(node, list):
        return [_form(branch, namespace, seen, skipped) for branch in node]
    kind = node["type"]
    if kind in PRIMITIVES:
        if LOGICAL_TYPE in skipped and "logicalType" in node:
            return {"type": kind, "logicalType": node["logicalType"]}
        return {"type": kind} if PRIMITIVE_OBJECT in skipped else kind
    if kind in ("record", "enum", "fixed", "error"):
        full = _qualify(node["name"], node.get("namespace", namespace))
        written = full if names else _short(full)
        if full in seen:
            return written
        seen.add(full)
        inner = full.rpartition(".")[0]
        out = {"name": written, "type": "record" if kind == "error" else kind}
        if "fields" in node:
            out["fields"] = [{"name": f["name"], "type": _form(f["type"], inner, seen, skipped)} for f in node["fields"]]
        if "symbols" in node:
            out["symbols"] = node["symbols"]
        if "size" in node:
            out["size"] = node["size"]
        return out
    if kind == "array":
        return {"type": "array", "items": _form(node["items"], namespace, seen, skipped)}
    if kind == "map":
        return {"type": "map", "values": _form(node["values"], namespace, seen, skipped)}
    return _form(kind, namespace, seen, skipped)  # {"type": "io.streamrft.Task"}: a reference in object form
