"""A run's principals made real: one SCRAM user per role with a random password, its credentials file (mode
0600), and the ACLs of :mod:`streamrft.acls`, created through the admin API by the cluster's admin.

``streamrft run`` does this on the embedded broker with ``broker.security`` on and starts every role with its own
credentials file; ``streamrft acls --apply --create-users DIR`` does it on any cluster. Doing it again is
harmless: existing credentials files are reused (the user's password is set to the file's again) and existing
ACLs stay as they are.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .acls import ROLES, principal_name, role_acls
from .config import KafkaConfig, RunConfig
from .credentials import Credential, read_credential, write_credential
from .kafka import KafkaClients, check_credentials
from .kafka.security import create_acls, upsert_scram_users

logger = logging.getLogger(__name__)


def credentials_path(directory: Path, config: RunConfig, role: str) -> Path:
    return directory / f"{principal_name(config, role)}.json"


def provision(admin: KafkaClients, directory: Path, roles: tuple[str, ...] = ROLES) -> dict[str, Path]:
    """Users, credentials files in ``directory`` and ACLs for ``roles`` of the run of ``admin`` (the clients of a
    super user, whose connection — protocol, CA — the users share). Returns role -> its credentials file."""
    config, connection = admin.config, admin.config.kafka
    files, passwords = {}, {}
    for role in roles:
        path = credentials_path(directory, config, role)
        if path.exists():
            credential = read_credential(path)
        else:
            credential = Credential.generate(principal_name(config, role), sasl_mechanism="SCRAM-SHA-512",
                                             security_protocol=connection.security_protocol,
                                             ssl_ca_location=connection.ssl_ca_location)
            write_credential(path, credential)
        passwords[credential.username] = credential.password.get_secret_value()
        files[role] = path
    upsert_scram_users(admin.admin(), passwords)
    created = create_acls(admin.admin(), [acl for role in roles for acl in role_acls(config, role)])
    for path in files.values():  # each user can log in before anyone is handed its file
        kafka = KafkaConfig(credentials_file=str(path))
        check_credentials(kafka, admin.bootstrap, settle_s=10.0)
    logger.info("run %s: %d principals (credentials in %s), %d ACLs", config.name, len(roles), directory, created)
    return files
