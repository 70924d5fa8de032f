"""Kafka's refusals, told as streamrft errors.

On a secured cluster a principal may lack an ACL. librdkafka then reports a bare error code
(``TOPIC_AUTHORIZATION_FAILED``, ...) that names neither the principal nor the resource; the client layer knows
both (the topic it produced to, the group it joined, its transactional id) and raises
:class:`~streamrft.errors.AuthorizationError` instead, whose message also gives the ACL that would allow the
operation and which of the run's principals have it (:func:`streamrft.acls.denial_message`). Authorization
errors are never retried: an ACL does not appear by waiting.
"""
from __future__ import annotations

from typing import Callable

from confluent_kafka import KafkaError

from ..acls import denial_message
from ..config import KafkaConfig, RunConfig
from ..errors import AuthenticationError, AuthorizationError

# librdkafka error code -> the kind of resource it refuses
REFUSED_RESOURCE = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "group",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "transactional_id",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "cluster",
}
_AUTHENTICATION = {KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED}

# refuse(error, operation, resource name) -> the error to raise
Refusal = Callable[[KafkaError, str, str], AuthorizationError]


def is_refusal(error: KafkaError) -> bool:
    return error.code() in REFUSED_RESOURCE


def is_authentication_failure(error: KafkaError) -> bool:
    return error.code() in _AUTHENTICATION


def refusal_for(config: RunConfig) -> Refusal:
    """The refusal builder of a run's clients."""

    def refuse(error: KafkaError, operation: str, name: str) -> AuthorizationError:
        resource = REFUSED_RESOURCE[error.code()]
        return AuthorizationError(denial_message(config, operation, resource, name if resource != "cluster" else "",
                                                 error.name()))

    return refuse


def authentication_failed(kafka: KafkaConfig, error: KafkaError) -> AuthenticationError:
    """The credentials were refused. librdkafka's text never holds the password; neither does this."""
    return AuthenticationError(
        f"Kafka refused the credentials of user {kafka.sasl_username!r} ({kafka.sasl_mechanism} over "
        f"{kafka.security_protocol}): {error.str()}. Check kafka.sasl_username and kafka.sasl_password "
        "(STREAMRFT_KAFKA__SASL_PASSWORD) or kafka.credentials_file; an embedded broker with security on keeps "
        "its admin's and each role's credentials files in <its data dir>/security."
    )
