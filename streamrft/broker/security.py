"""The embedded broker with security on (``broker.security``): SASL/SCRAM users, optionally TLS, and ACLs.

- ``sasl_scram``: clients authenticate with SCRAM-SHA-512 on a SASL_PLAINTEXT listener;
- ``sasl_scram_tls``: the same over TLS (SASL_SSL), with a CA and a broker certificate (for 127.0.0.1 and
  localhost) generated at the first start;
- either way the KRaft ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``: a principal may do
  only what an ACL allows (``streamrft acls``), and ``User:admin`` is the one super user.

The admin authenticates with PLAIN, checked against the broker's own properties file, so its password never
appears on a command line (``kafka-storage format --add-scram`` would put it there) and SCRAM users can be
created through the admin API as soon as the broker is up; PLAIN accepts no other user. Everything lives in
``<data dir>/security`` (mode 0700): the admin's credentials file, the CA certificate, the broker's key and
certificate (mode 0600), and the credentials files of the users created for runs (``credentials/``). A kept data
dir keeps them, so a restarted broker has the same users, passwords and certificates.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..credentials import Credential, private_dir, read_credential, write_credential

SecurityMode = Literal["none", "sasl_scram", "sasl_scram_tls"]
ADMIN_USER = "admin"
SCRAM = "SCRAM-SHA-512"
SECURITY_DIR = "security"
ADMIN_FILE = "admin.json"


@dataclass(frozen=True)
class BrokerSecurity:
    mode: SecurityMode
    directory: Path
    admin: Credential

    @classmethod
    def prepare(cls, mode: SecurityMode, data_dir: Path, host: str) -> "BrokerSecurity":
        """The broker's security material in ``data_dir``, made at the first start and reused after."""
        directory = private_dir(data_dir / SECURITY_DIR)
        tls = mode == "sasl_scram_tls"
        if tls and not (directory / "ca.pem").exists():
            _write_tls_material(directory, host)
        admin_file = directory / ADMIN_FILE
        connection = {"sasl_mechanism": "PLAIN", "security_protocol": "SASL_SSL" if tls else "SASL_PLAINTEXT",
                      "ssl_ca_location": str(directory / "ca.pem") if tls else None}
        if admin_file.exists():  # a kept data dir: the same password, the connection of this start's mode
            admin = read_credential(admin_file).model_copy(update=connection)
        else:
            admin = Credential.generate(ADMIN_USER, **connection)
        write_credential(admin_file, admin)  # others (`streamrft broker start` users) find the admin here
        return cls(mode, directory, admin)

    @property
    def tls(self) -> bool:
        return self.mode == "sasl_scram_tls"

    @property
    def credentials_dir(self) -> Path:
        """Where the credentials files of the users created for runs go."""
        return private_dir(self.directory / "credentials")

    def server_properties(self) -> str:
        """The listener, SASL, TLS and authorizer settings (appended to the broker's server.properties)."""
        password = self.admin.password.get_secret_value()
        plain = (f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{ADMIN_USER}" '
                 f'password="{password}" user_{ADMIN_USER}="{password}";')
        lines = [
            f"listener.security.protocol.map=CLIENT:{self.admin.security_protocol},CONTROLLER:SASL_PLAINTEXT",
            f"listener.name.client.sasl.enabled.mechanisms={SCRAM},PLAIN",
            f"listener.name.client.plain.sasl.jaas.config={plain}",
            f"listener.name.client.{SCRAM.lower()}.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
            f"listener.name.controller.plain.sasl.jaas.config={plain}",
            "sasl.mechanism.inter.broker.protocol=PLAIN",
            "sasl.mechanism.controller.protocol=PLAIN",
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found=false",
            f"super.users=User:{ADMIN_USER}",
        ]
        if self.tls:
            lines += [
                "ssl.keystore.type=PEM",
                f"ssl.keystore.location={self.directory / 'broker.pem'}",
                "ssl.truststore.type=PEM",
                f"ssl.truststore.location={self.directory / 'ca.pem'}",
            ]
        return "\n".join(lines) + "\n"

    def client_properties(self) -> dict[str, str]:
        """librdkafka properties of the admin (the broker's own readiness checks)."""
        props = {"security.protocol": self.admin.security_protocol, "sasl.mechanism": "PLAIN",
                 "sasl.username": ADMIN_USER, "sasl.password": self.admin.password.get_secret_value()}
        if self.tls:
            props["ssl.ca.location"] = str(self.directory / "ca.pem")
        return props


def _write_tls_material(directory: Path, host: str) -> None:
    """A CA, and a broker key and certificate signed by it for ``host`` and localhost (valid a year)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamrft embedded broker CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=365))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(host))]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    keystore = directory / "broker.pem"
    keystore.touch(mode=0o600)
    keystore.write_bytes(key_pem + cert.public_bytes(pem) + ca.public_bytes(pem))
