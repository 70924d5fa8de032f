"""Credentials files: one Kafka principal's username, password and how to connect, kept out of configs,
environments and logs.

A file is JSON, mode 0600, in a directory of mode 0700::

    {"username": "demo.trainer", "password": "...", "sasl_mechanism": "SCRAM-SHA-512",
     "security_protocol": "SASL_SSL", "ssl_ca_location": "/path/to/ca.pem"}

A role reads its own with ``kafka.credentials_file`` (``STREAMRFT_KAFKA__CREDENTIALS_FILE``), which
``streamrft run`` sets for each role it starts; the embedded broker writes its admin's, ``streamrft run`` and
``streamrft acls --create-users`` the roles'. A file others may read is refused, as ssh refuses a key.
"""
from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr


class Credential(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    username: str
    password: SecretStr
    sasl_mechanism: str = "SCRAM-SHA-512"
    security_protocol: str = "SASL_PLAINTEXT"
    ssl_ca_location: str | None = None

    @classmethod
    def generate(cls, username: str, **connection) -> "Credential":
        """A new credential with a random 32-byte password."""
        return cls(username=username, password=SecretStr(secrets.token_urlsafe(32)), **connection)

    def kafka_settings(self) -> dict[str, str | None]:
        """The ``kafka`` section keys this credential sets."""
        return {"sasl_username": self.username, "sasl_password": self.password.get_secret_value(),
                "sasl_mechanism": self.sasl_mechanism, "security_protocol": self.security_protocol,
                "ssl_ca_location": self.ssl_ca_location}


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_credential(path: Path, credential: Credential) -> Path:
    """Write ``credential`` to ``path`` (mode 0600 from the start: it is never readable by others)."""
    private_dir(path.parent)
    data = credential.model_dump(mode="json") | {"password": credential.password.get_secret_value()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)
    return path


def read_credential(path: str | os.PathLike) -> Credential:
    """The credential in ``path``; ValueError saying how to fix a missing, unreadable, shared or malformed
    file (never showing its contents)."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"credentials file {path} does not exist") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"credentials file {path} can be read by others (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    try:
        return Credential.model_validate(json.loads(path.read_text()))
    except (ValueError, OSError) as exc:
        reason = type(exc).__name__ if not isinstance(exc, OSError) else exc.strerror
        raise ValueError(f"credentials file {path} is not a credentials JSON object ({reason}); it needs "
                         "username and password, and may give sasl_mechanism, security_protocol and "
                         "ssl_ca_location") from None
