"""SCRAM users and ACLs through the admin API (the client of a super user: the cluster's admin)."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaException
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType, AdminClient,
                                   ResourcePatternType, ResourceType, ScramCredentialInfo, ScramMechanism,
                                   UserScramCredentialUpsertion)

from ..acls import Acl
from .authorization import is_refusal

logger = logging.getLogger(__name__)

SCRAM_ITERATIONS = 8192  # Kafka's minimum for SCRAM-SHA-512 is 4096
_RESOURCES = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP,
              "transactional_id": ResourceType.TRANSACTIONAL_ID}
_PATTERNS = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}
_OPERATIONS = {"read": AclOperation.READ, "write": AclOperation.WRITE, "describe": AclOperation.DESCRIBE,
               "describe_configs": AclOperation.DESCRIBE_CONFIGS}


class AdminRefused(RuntimeError):
    """The configured principal may not manage users or ACLs (it is not the cluster's admin)."""


def upsert_scram_users(admin: AdminClient, passwords: Mapping[str, str], timeout: float = 30.0) -> None:
    """Create the SCRAM-SHA-512 users (or set their passwords, for users that exist)."""
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    alterations = [UserScramCredentialUpsertion(user, info, password.encode()) for user, password in passwords.items()]
    for user, future in admin.alter_user_scram_credentials(alterations, request_timeout=timeout).items():
        _result(future, f"creating SCRAM user {user}")
    logger.info("SCRAM users set: %s", ", ".join(sorted(passwords)))


def create_acls(admin: AdminClient, acls: Iterable[Acl], timeout: float = 30.0) -> int:
    """Create the ACLs (ALLOW, any host); ones that exist are left as they are. Returns how many were given."""
    bindings = [AclBinding(_RESOURCES[a.resource], a.name, _PATTERNS[a.pattern], a.principal, "*",
                           _OPERATIONS[a.operation], AclPermissionType.ALLOW) for a in acls]
    if not bindings:
        return 0
    for binding, future in admin.create_acls(bindings, request_timeout=timeout).items():
        _result(future, f"creating ACL {binding}")
    return len(bindings)


def principal_acls(admin: AdminClient, principal: str, timeout: float = 30.0) -> list[AclBinding]:
    """The ACLs the cluster holds for ``principal``."""
    acl_filter = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, principal, None,
                                  AclOperation.ANY, AclPermissionType.ANY)
    return _result(admin.describe_acls(acl_filter, request_timeout=timeout), f"listing the ACLs of {principal}")


def _result(future, what: str):
    try:
        return future.result()
    except KafkaException as exc:
        if is_refusal(exc.args[0]):
            raise AdminRefused(f"{what}: the cluster refused it ({exc.args[0].name()}); users and ACLs are "
                               "managed by its admin principal (super.users)") from None
        raise
