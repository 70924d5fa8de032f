"""How to reach Kafka (and the schema registry), and the embedded broker. The topics are in ``topics.py``."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from .base import Section

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]
EMBEDDED_REGISTRY = "embedded"  # schema_registry.url that starts the embedded registry


class KafkaConfig(Section):
    """Connection settings. An empty ``bootstrap_servers`` means: start the embedded broker."""

    bootstrap_servers: str = Field(
        default="", description="host:port[,host:port...] of the Kafka cluster; empty = `streamrft run` starts the "
                                "embedded broker (the broker section) and hands every role its address")
    security_protocol: SecurityProtocol = Field(
        default="PLAINTEXT", description="librdkafka security.protocol; SASL_* needs sasl_mechanism and, for PLAIN "
                                         "and SCRAM, a username and password")
    sasl_mechanism: SaslMechanism | None = Field(default=None,
                                                 description="librdkafka sasl.mechanism; required by SASL_* protocols")
    sasl_username: str | None = Field(default=None, description="the SASL principal (PLAIN, SCRAM)")
    sasl_password: SecretStr | None = Field(
        default=None, description="the SASL principal's password; set it through the environment "
                                  "(STREAMRFT_KAFKA__SASL_PASSWORD) or credentials_file, not in a config file")
    ssl_ca_location: str | None = Field(default=None, description="PEM file of the CA that signed the brokers' "
                                                                  "certificates (SSL, SASL_SSL); none = the system's")
    credentials_file: str | None = Field(
        default=None, description="a credentials file (streamrft/credentials.py) giving the principal and its "
                                  "connection instead of the sasl_* keys: what `streamrft run` hands each role "
                                  "of a secured run, so no password is in a config file or an environment")
    # the client layer's own guarantees (acks, idempotence, isolation level) win over these pass-throughs, so a
    # property here cannot weaken exactly-once delivery
    producer: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="librdkafka producer properties passed through as-is (e.g. linger.ms); "
                                          "the keys above and the client layer's guarantees win over them")
    consumer: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="librdkafka consumer properties passed through as-is (e.g. "
                                          "fetch.max.bytes); the keys above and the client layer's guarantees win")
    admin: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="librdkafka admin-client properties passed through as-is; the keys above "
                                          "win over them")

    @property
    def embedded(self) -> bool:
        return not self.bootstrap_servers.strip()

    @property
    def authenticated(self) -> bool:
        return self.security_protocol.startswith("SASL")

    @model_validator(mode="before")
    @classmethod
    def _read_credentials_file(cls, data: Any) -> Any:
        """The credentials file's principal and connection; explicit keys for the connection win, a username or
        password given twice is an error."""
        if not isinstance(data, dict) or not data.get("credentials_file"):
            return data
        from streamrft.credentials import read_credential

        given = [key for key in ("sasl_username", "sasl_password") if data.get(key)]
        if given:
            raise ValueError(f"kafka.credentials_file and kafka.{given[0]} are both set; give the principal in one "
                             "place")
        settings = read_credential(data["credentials_file"]).kafka_settings()
        return {**{k: v for k, v in settings.items() if v is not None},
                **{k: v for k, v in data.items() if v is not None}}

    @model_validator(mode="after")
    def _sasl_complete(self) -> "KafkaConfig":
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ValueError(
                f"security_protocol {self.security_protocol} needs kafka.sasl_mechanism "
                "(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or GSSAPI)"
            )
        if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") and not (
            self.sasl_username and self.sasl_password
        ):
            raise ValueError(
                f"sasl_mechanism {self.sasl_mechanism} needs kafka.sasl_username and kafka.sasl_password "
                "(set the password with STREAMRFT_KAFKA__SASL_PASSWORD rather than in the file)"
            )
        return self

    def client_properties(self, bootstrap: str) -> dict[str, str]:
        """librdkafka properties common to every client of this cluster."""
        props: dict[str, str] = {"bootstrap.servers": bootstrap, "security.protocol": self.security_protocol}
        if self.sasl_mechanism:
            props["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            props["sasl.username"] = self.sasl_username
        if self.sasl_password:
            props["sasl.password"] = self.sasl_password.get_secret_value()
        if self.ssl_ca_location:
            props["ssl.ca.location"] = self.ssl_ca_location
        return props


class SchemaRegistryConfig(Section):
    """When ``url`` is set, records are framed in the Confluent wire format through the registry, so tools
    such as Kafka UI show them decoded; otherwise Avro single-object encoding, which needs no registry."""

    url: str = Field(
        default="", description="http(s):// address of a Confluent-compatible schema registry; `embedded` = "
                                "`streamrft run` starts Apicurio Registry on loopback; empty = no registry (Avro "
                                "single-object encoding)")
    basic_auth_user_info: SecretStr | None = Field(
        default=None, description="USER:PASSWORD for the registry's HTTP basic auth; set it through the "
                                  "environment (STREAMRFT_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO)")
    auto_register_schemas: bool = Field(
        default=True, description="producers register a schema the registry does not know yet; false = only "
                                  "schemas registered beforehand may be written")
    embedded_version: str = Field(default="3.0.9", pattern=r"^[0-9][0-9A-Za-z.\-]*$",
                                  description="url: embedded: the Apicurio Registry release to run (3.0.x runs on "
                                              "Java 17; later ones need Java 21)")
    embedded_heap: str = Field(default="256m", pattern=r"^[0-9]+[kKmMgG]$",
                               description="url: embedded: the registry JVM's -Xmx")
    embedded_start_timeout_s: float = Field(default=120.0, gt=0, le=600,
                                            description="url: embedded: seconds to wait for the registry to answer")
    compatibility: Literal["BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FULL", "NONE"] = Field(
        default="BACKWARD", description="url: embedded: the global compatibility rule set on start; a producer "
                                        "registering a schema that breaks it is refused")

    @property
    def enabled(self) -> bool:
        return bool(self.url.strip())

    @property
    def embedded(self) -> bool:
        """``url: embedded``: `streamrft run` starts a registry on loopback and hands the roles its address."""
        return self.url.strip() == EMBEDDED_REGISTRY

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if value and value.strip() != EMBEDDED_REGISTRY and not re.match(r"^(https?|mock)://", value):
            raise ValueError(
                "schema_registry.url must start with http:// or https://, or be `embedded` (a registry started on "
                "loopback by `streamrft run`); mock:// for tests; empty for none"
            )
        return value


# A loopback cluster of combined broker+controller nodes: every node is a KRaft voter, so 3 tolerates losing
# one and 5 losing two; more is a job for a real cluster (its controllers apart from its brokers).
MAX_NODES = 5


class EmbeddedBrokerConfig(Section):
    """The KRaft broker streamrft starts when ``kafka.bootstrap_servers`` is empty: one node, or ``nodes`` of them
    as a replicated cluster on loopback (streamrft/broker/)."""

    kafka_version: str = Field(default="4.1.1", description="the Apache Kafka release whose jars run the broker "
                                                             "(fetched with Maven on first use)")
    nodes: int = Field(
        default=1, description="1: one node; 3 to 5: a replicated cluster on loopback, each node a broker and KRaft "
                               "controller in its own JVM with its own data dir and ports; topics then get "
                               "replication factor min(3, nodes) and min.insync.replicas 2")
    security: Literal["none", "sasl_scram", "sasl_scram_tls"] = Field(
        default="none", description="none: PLAINTEXT, anyone on this machine may do anything; sasl_scram: "
                                    "SCRAM-SHA-512 users and ACLs, each role of `streamrft run` its own principal; "
                                    "sasl_scram_tls: the same over TLS (streamrft/broker/security.py)")
    data_dir: str | None = Field(default=None, description="the nodes' data directory; none = a fresh temporary "
                                                           "one")
    keep_data: bool = Field(default=False, description="keep the data directory when the broker stops, for the "
                                                       "next start to reuse; false = it is deleted, given or not")
    heap: str = Field(default="512m", description="JVM -Xmx of each node, e.g. 512m or 2g")
    start_timeout_s: float = Field(default=90.0, gt=0, description="seconds to wait for the broker (every node) "
                                                                   "to accept clients before giving up")

    @field_validator("nodes")
    @classmethod
    def _cluster_size(cls, nodes: int) -> int:
        if nodes == 2:
            raise ValueError(
                "2 nodes make a KRaft quorum that stops when either node stops (a majority of 2 is 2), and topics "
                "that cannot keep 2 in-sync replicas through the loss of one: less available than 1 node. Use 1, "
                "or 3 for a cluster that survives losing a broker")
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"the embedded broker runs 1 node or a cluster of 3 to {MAX_NODES} (each a JVM of "
                             "broker.heap on this machine); for more, point kafka.bootstrap_servers at a real cluster")
        return nodes

    @property
    def replication_factor(self) -> int:
        """Of every topic the embedded broker creates by default, its internal topics included."""
        return min(3, self.nodes)

    @property
    def min_insync_replicas(self) -> int:
        """Replicas that must have a write before it is acknowledged (acks=all): 2 of 3, so one broker may be
        down without refusing writes, and an acknowledged write survives the loss of any one."""
        return 2 if self.nodes >= 3 else 1
