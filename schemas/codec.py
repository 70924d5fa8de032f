"""Avro single-object encoding of records: ``C3 01`` + 8-byte CRC-64-AVRO fingerprint + Avro binary body.

Needs no registry: the fingerprint names the writer schema, and the decoder resolves it against the current
(reader) schema, so records written by an older schema version still decode, with defaults for new fields.
The Confluent wire format (schema registry) is handled one layer up, in ``streamrft.kafka.serde``, because it needs
``confluent_kafka``.
"""
from __future__ import annotations

import struct
from functools import cache
from io import BytesIO
from typing import Callable, TypeVar

from fastavro import schemaless_reader, schemaless_writer

from .canonical_rules import BYTE_ORDER, Rule, describe_skips, match_skips
from .compiled import CompiledRecord, Malformed, Truncated, Unsupported, compile_record
from .contract import RECORD_NAMES, fingerprint64, parsed, previous_schemas, schema_json
from .records import RECORD_TYPES, Record

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
HEADER_SIZE = len(SINGLE_OBJECT_MAGIC) + 8

R = TypeVar("R", bound=Record)


class DecodeError(ValueError):
    """A payload that cannot become a record. ``reason`` is a short machine-friendly tag for DLQ headers."""

    reason = "decode-error"


class UnknownMagicError(DecodeError):
    reason = "unknown-magic"

    def __init__(self, magic: bytes):
        self.magic = magic
        super().__init__(
            f"unknown framing: first bytes {magic.hex() or '(empty)'}; expected c301 (Avro single-object) "
            f"or 00 (Confluent schema-registry wire format)"
        )


class UnknownFingerprintError(DecodeError):
    """A single-object payload whose fingerprint no known writer schema has. ``skipped``: the record it is
    when its fingerprint is that record's schema computed without some steps of the canonical form."""

    reason = "unknown-fingerprint"

    def __init__(self, fp: bytes, skipped: tuple[str, bytes, frozenset[Rule]] | None = None):
        self.fingerprint = fp
        self.skipped = skipped
        if skipped is not None:
            name, spec_fp, rules = skipped
            how = ("in the wrong byte order" if BYTE_ORDER in rules else
                   "computed over a form that is not Avro's Parsing Canonical Form")
            detail = (f"it is the {name} schema's fingerprint {how}: {describe_skips(rules)}. Compute it over "
                      f"the canonical form and write it little-endian (the "
                      f"{name} schema's fingerprint is {spec_fp.hex()} on the wire; `streamrft schemas` prints "
                      "each record type's form and fingerprint), or produce through a schema registry")
        else:
            detail = ("no known writer schema has it. A writer of the contract's schemas whose library computes "
                      f"fingerprints over another form gets this: {SPEC_STEPS}. An evolved schema of the writer's "
                      "own is known only through a schema registry (schema_registry.url) or "
                      "SingleObjectCodec.register_writer_schema()")
        super().__init__(f"unknown schema fingerprint {fp.hex()}: {detail}")


# The steps of the canonical form libraries are known to skip, for the message of an unknown fingerprint.
SPEC_STEPS = ('the Parsing Canonical Form drops logicalType, writes {"type":"long"} as "long" and names named types '
              'by their full names; hamba/avro and goavro compute fingerprints without the first two steps; '
              '`streamrft schemas` prints each record type\'s canonical form and fingerprint')


class TruncatedRecordError(DecodeError):
    reason = "truncated"


class WrongRecordTypeError(DecodeError):
    reason = "wrong-record-type"


class InvalidRecordError(DecodeError):
    """A payload that decodes but breaks what its record type promises (lengths that do not line up, a
    non-finite reward, a key that is not UTF-8, a record larger than the run allows). ``reason`` is set per
    instance, e.g. ``experience-lengths``."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(detail)


def framing_of(data: bytes) -> str:
    """'single-object' or 'confluent'; raises UnknownMagicError for anything else."""
    if data[:2] == SINGLE_OBJECT_MAGIC:
        return "single-object"
    if data[:1] == CONFLUENT_MAGIC and len(data) >= 5:
        return "confluent"
    raise UnknownMagicError(bytes(data[:2]))


@cache
def _compiled(name: str) -> CompiledRecord | None:
    """The generated encoder/decoder of the current schema of ``name`` (header included); None: fastavro only."""
    schema = schema_json(name)
    try:
        return compile_record(schema, RECORD_TYPES, SINGLE_OBJECT_MAGIC + fingerprint64(schema))
    except Unsupported:
        return None


class SingleObjectCodec:
    """Encodes records of the contract and decodes any known writer version of them.

    Records of the current schemas go through code generated for each schema (``compiled.py``, ~3x faster than
    fastavro's generic walk, same bytes); payloads of older writer schemas are resolved by fastavro."""

    def __init__(self) -> None:
        self._writers: dict[str, tuple[bytes, dict]] = {}  # record name -> (fingerprint, parsed schema)
        self._readers: dict[str, dict] = {}  # record name -> parsed current schema (the same parsed object)
        self._fast_encode: dict[str, Callable[[Record], bytes]] = {}  # record name -> generated encoder
        # fingerprint -> (record name, parsed writer schema, generated decoder or None: fastavro resolves it)
        self._by_fingerprint: dict[bytes, tuple[str, dict, Callable | None]] = {}
        self._sources: list[tuple[str, dict]] = []  # (record name, writer schema as written), for diagnoses
        self._diagnosed: dict[bytes, tuple[str, bytes, frozenset[Rule]] | None] = {}
        for name in RECORD_NAMES:
            schema = schema_json(name)
            fp = fingerprint64(schema)
            current = parsed(schema)
            compiled = _compiled(name)
            self._writers[name] = (fp, current)
            self._readers[name] = current
            self._by_fingerprint[fp] = (name, current, compiled.decode if compiled else None)
            self._sources.append((name, schema))
            if compiled is not None:
                self._fast_encode[name] = compiled.encode
        for name, schema in previous_schemas():
            self.register_writer_schema(name, schema)

    def register_writer_schema(self, record_name: str, schema: dict) -> bytes:
        """Accept payloads written with an older (or other compatible) version of ``record_name``'s schema."""
        if record_name not in self._readers:
            raise KeyError(f"unknown record {record_name!r}; known: {', '.join(RECORD_NAMES)}")
        fp = fingerprint64(schema)
        self._by_fingerprint[fp] = (record_name, parsed(schema), None)
        self._sources.append((record_name, schema))
        self._diagnosed.clear()
        return fp

    def knows(self, fp: bytes) -> bool:
        return fp in self._by_fingerprint

    def diagnose(self, fp: bytes) -> tuple[str, bytes, frozenset[Rule]] | None:
        """(record, its fingerprint, the canonical-form steps skipped) when ``fp`` is a known schema's
        fingerprint computed without some steps of the canonical form, else None (computed once per ``fp``)."""
        if fp not in self._diagnosed:
            if len(self._diagnosed) > 1024:  # garbage fingerprints: keep the memo bounded
                self._diagnosed.clear()
            found = match_skips(fp, self._sources)
            self._diagnosed[fp] = None if found is None else (found[0], self._writers[found[0]][0], found[1])
        return self._diagnosed[fp]

    def fingerprint(self, record_type: type[Record]) -> bytes:
        return self._writers[record_type.schema_name][0]

    def encode(self, record: Record) -> bytes:
        fast = self._fast_encode.get(record.schema_name)
        if fast is not None:
            try:
                return fast(record)
            except Exception:  # noqa: BLE001 - a value the generated code does not take: fastavro below either
                pass  # writes it (identically) or raises its own error naming the field
        fp, schema = self._writers[record.schema_name]
        buf = BytesIO()
        buf.write(SINGLE_OBJECT_MAGIC)
        buf.write(fp)
        schemaless_writer(buf, schema, record.to_dict())
        return buf.getvalue()

    def encode_with(self, schema: dict, datum: dict) -> bytes:
        """Encode a raw datum with an arbitrary writer schema (tests and producers of older versions)."""
        buf = BytesIO()
        buf.write(SINGLE_OBJECT_MAGIC)
        buf.write(fingerprint64(schema))
        schemaless_writer(buf, parsed(schema), datum)
        return buf.getvalue()

    def decode(self, data: bytes, expected: type[R] | None = None) -> R:
        """Decode a single-object payload into its record class; ``expected`` rejects other record types."""
        if len(data) < HEADER_SIZE or data[:2] != SINGLE_OBJECT_MAGIC:
            if data[:2] == SINGLE_OBJECT_MAGIC:
                raise TruncatedRecordError(f"payload of {len(data)} bytes is shorter than the 10-byte header")
            raise UnknownMagicError(bytes(data[:2]))
        fp = bytes(data[2:HEADER_SIZE])
        try:
            name, writer, fast = self._by_fingerprint[fp]
        except KeyError:
            raise UnknownFingerprintError(fp, self.diagnose(fp)) from None
        if expected is not None and expected.schema_name != name:
            raise WrongRecordTypeError(f"payload is a {name}, expected a {expected.schema_name}")
        if fast is not None:
            return self._decode_fast(name, fast, data if type(data) is bytes else bytes(data))
        datum = self.decode_body(name, writer, data[HEADER_SIZE:])
        return RECORD_TYPES[name].from_dict(datum)  # type: ignore[return-value]

    @staticmethod
    def _decode_fast(name: str, decode, data: bytes):
        try:
            record, end = decode(data, HEADER_SIZE)
        except (Truncated, IndexError, struct.error) as exc:  # indexing or unpacking past the end
            raise TruncatedRecordError(f"{name} body ends early ({len(data) - HEADER_SIZE} bytes): {exc}") from exc
        except Exception as exc:  # Malformed, UnicodeDecodeError, a converter refusing a value, ...
            detail = str(exc) if isinstance(exc, Malformed) else repr(exc)
            raise DecodeError(f"{name} body is not valid Avro: {detail}") from exc
        if end != len(data):
            raise DecodeError(f"{name} body has {len(data) - end} trailing bytes")
        return record

    def decode_body(self, name: str, writer: dict, body: bytes) -> dict:
        """Decode an Avro binary body written with ``writer`` into the current schema of ``name``."""
        reader = self._readers[name]
        stream = BytesIO(body)
        try:
            datum = schemaless_reader(stream, writer, reader if writer is not reader else None)
        except (EOFError, StopIteration, IndexError) as exc:
            raise TruncatedRecordError(f"{name} body ends early ({len(body)} bytes): {exc!r}") from exc
        except Exception as exc:  # fastavro raises assorted errors on garbage (ValueError, UnicodeDecodeError, ...)
            raise DecodeError(f"{name} body is not valid Avro: {exc!r}") from exc
        if stream.tell() != len(body):
            raise DecodeError(f"{name} body has {len(body) - stream.tell()} trailing bytes")
        return datum
