"""Record <-> bytes on a topic: Avro single-object encoding by default, the Confluent schema-registry wire
format when ``schema_registry.url`` is set. Decoding recognises both framings whatever is configured for
writing, so a topic can hold records from producers of either kind."""
from __future__ import annotations

import json
import logging
from typing import TypeVar

from streamrft.schemas import DecodeError, Record, SingleObjectCodec, framing_of, schema_json
from streamrft.schemas.records import RECORD_TYPES
from ..config import SchemaRegistryConfig
from ..errors import ConfigError, SchemaIncompatibleError

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)


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
            return self.codec.decode(data, expected)
        return self._decode_confluent(data, topic, expected)

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
