"""Record <-> bytes on a topic: Avro single-object encoding by default, the Confluent schema-registry wire
format when ``schema_registry.url`` is set. Decoding recognises both framings whatever is configured for
writing, so a topic can hold records from producers of either kind.

Any writer schema that resolves against the reader's (Avro's rules: a field the reader lacks is skipped, one the
writer lacks takes the reader's default) is read: through the registry, by the schema id of a Confluent-framed
record, or by the fingerprint of a single-object one, looked up among the schemas registered under the topic's
subject. Without a registry, a single-object record is read only when its fingerprint is one of the contract's
(current or ``schemas/previous/``)."""
from __future__ import annotations

import json
import logging
import time
from typing import TypeVar

from streamrft.schemas import (DecodeError, Record, SingleObjectCodec, UnknownFingerprintError, framing_of,
                               schema_json)
from streamrft.schemas.records import RECORD_TYPES
from ..config import SchemaRegistryConfig
from ..errors import ConfigError, SchemaIncompatibleError

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)


LOOKUP_INTERVAL_S = 5.0  # a subject's versions are listed again for an unknown fingerprint at most this often


class RegistryNotConfiguredError(DecodeError):
    reason = "registry-not-configured"


class Serde:
    """Encodes records for ``topic`` and decodes payloads into the record class a topic carries."""

    def __init__(self, registry: SchemaRegistryConfig | None = None):
        self.codec = SingleObjectCodec()
        self.registry = registry if registry is not None and registry.enabled else None
        self._client = None
        self._serializers: dict[str, object] = {}
        self._deserializers: dict[str, object] = {}
        self._versions_read: set[tuple[str, int]] = set()  # (subject, version) registered with the codec
        self._listed_at: dict[str, float] = {}  # subject -> monotonic time its versions were last listed

    # -- encoding -------------------------------------------------------------------------------------------
    def encode(self, record: Record, topic: str) -> bytes:
        if self.registry is None:
            return self.codec.encode(record)
        from confluent_kafka.serialization import MessageField, SerializationContext

        serializer = self._serializer(record.schema_name)
        context = SerializationContext(topic, MessageField.VALUE)
        try:
            return serializer(record, context)
        except Exception as exc:
            if getattr(exc, "http_status_code", None) == 409:  # the registry's answer to an incompatible schema
                raise self._incompatible(record.schema_name, f"{topic}-value", exc) from exc
            raise

    def _incompatible(self, name: str, subject: str, exc: Exception) -> SchemaIncompatibleError:
        reason = getattr(exc, "error_message", None) or str(exc)
        return SchemaIncompatibleError(
            f"the schema registry at {self.registry.url} refused the {name} schema for subject {subject!r}: it "
            f"breaks the subject's compatibility rule ({reason}). Make the change to schemas/{name}.avsc "
            "backward compatible (give every new field a default, keep the types of the fields that stay), or "
            "write to a new run (its topics, and so its subjects, are new); to replace the contract on purpose, "
            f"delete the subject (DELETE {self.registry.url}/subjects/{subject})")

    # -- decoding -------------------------------------------------------------------------------------------
    def decode(self, data: bytes | None, topic: str, expected: type[R] | None = None) -> R:
        if data is None:
            raise DecodeError("record has no value (tombstone or null payload)")
        if framing_of(data) == "single-object":
            try:
                return self.codec.decode(data, expected)
            except UnknownFingerprintError as exc:
                if self.registry is None or expected is None or not self._learn_writer(exc.fingerprint, topic,
                                                                                       expected):
                    raise
            return self.codec.decode(data, expected)
        return self._decode_confluent(data, topic, expected)

    def _learn_writer(self, fp: bytes, topic: str, expected: type[Record]) -> bool:
        """Look ``fp`` up among the schemas registered under ``<topic>-value``; True when one has it (it is a
        writer schema of ``expected`` from now on). Each version is fetched once; the versions are listed at
        most every LOOKUP_INTERVAL_S per subject, so a run of garbage fingerprints does not flood the registry."""
        subject = f"{topic}-value"
        now = time.monotonic()
        if now - self._listed_at.get(subject, -LOOKUP_INTERVAL_S) < LOOKUP_INTERVAL_S:
            return False
        self._listed_at[subject] = now
        client = self._registry_client()
        try:
            versions = client.get_versions(subject)
        except Exception as exc:  # noqa: BLE001 - an unknown subject (404) or a registry away: the record is unknown
            logger.info("fingerprint %s: the versions of subject %s could not be listed (%s)", fp.hex(), subject, exc)
            return False
        for version in versions:
            if (subject, version) in self._versions_read:
                continue
            self._versions_read.add((subject, version))
            try:  # every version of the subject is a writer schema of the topic's record type
                schema = json.loads(client.get_version(subject, version).schema.schema_str)
                known = self.codec.register_writer_schema(expected.schema_name, schema)
            except Exception as exc:  # noqa: BLE001 - a schema with references, or not Avro: not a single-object writer
                logger.info("subject %s version %s is not a self-contained Avro schema (%s)", subject, version, exc)
                continue
            logger.info("writer schema %s of %s: version %s of subject %s", known.hex(), expected.schema_name,
                        version, subject)
        return self.codec.knows(fp)

    def _decode_confluent(self, data: bytes, topic: str, expected: type[R] | None) -> R:
        if self.registry is None:
            raise RegistryNotConfiguredError(
                "record uses the Confluent schema-registry wire format (magic byte 00) but no "
                "schema_registry.url is configured; set it to decode such records"
            )
        if expected is None:
            raise DecodeError("Confluent-framed records need the expected record type to pick a reader schema")
        from confluent_kafka.serialization import MessageField, SerializationContext

        try:
            return self._deserializer(expected.schema_name)(data, SerializationContext(topic, MessageField.VALUE))
        except (DecodeError, ConfigError):  # a misconfigured reader is no bad record: nothing to dead-letter
            raise
        except Exception as exc:  # registry lookups and Avro errors arrive as assorted exception types
            raise DecodeError(f"Confluent-framed {expected.schema_name} could not be decoded: {exc}") from exc

    # -- schema registry (confluent_kafka.schema_registry does the protocol) ------------------------------------
    def _registry_client(self):
        if self._client is None:
            from confluent_kafka.schema_registry import SchemaRegistryClient

            if self.registry.embedded:
                raise ConfigError(
                    "schema_registry.url is `embedded`, which `streamrft run` replaces with the address of the "
                    "registry it starts; a command or role started on its own needs that address: set "
                    "STREAMRFT_SCHEMA_REGISTRY__URL (or schema_registry.url) to the registry's http:// URL")
            conf = {"url": self.registry.url}
            if self.registry.basic_auth_user_info is not None:
                conf["basic.auth.user.info"] = self.registry.basic_auth_user_info.get_secret_value()
            self._client = SchemaRegistryClient.new_client(conf)  # mock:// URLs get the in-process registry
        return self._client

    def _serializer(self, name: str):
        if name not in self._serializers:
            from confluent_kafka.schema_registry.avro import AvroSerializer

            self._serializers[name] = AvroSerializer(
                self._registry_client(),
                json.dumps(schema_json(name)),
                to_dict=lambda record, ctx: record.to_dict(),
                conf={"auto.register.schemas": self.registry.auto_register_schemas},
            )
        return self._serializers[name]

    def _deserializer(self, name: str):
        if name not in self._deserializers:
            from confluent_kafka.schema_registry.avro import AvroDeserializer

            record_type = RECORD_TYPES[name]
            self._deserializers[name] = AvroDeserializer(
                self._registry_client(),
                json.dumps(schema_json(name)),
                from_dict=lambda datum, ctx: record_type.from_dict(datum),
            )
        return self._deserializers[name]
