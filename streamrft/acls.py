"""Who may do what on a run's topics, groups and transactional ids: one principal per role, derived from the run
config, for a Kafka cluster that other teams share.

Each role's principal is ``User:<run>.<role>`` (a SCRAM user named ``<run>.<role>``), and it gets exactly the
operations its code performs, nothing on another run's resources:

=============  ===========================================================================================
role           allowed
=============  ===========================================================================================
``tasks``      WRITE ``tasks`` and the tasksets' own topics ``tasks.<name>`` (task producers: files, datasets, an
               agent application)
``explorer``   READ ``tasks`` and ``results`` (group ``<run>.explorer``); WRITE ``rollouts`` and ``control``
               (its state, cancelled steps); DESCRIBE ``experiences`` and group ``<run>.trainer`` (the trainer's
               lag); transactional id ``<run>.explorer``
``rollout``    READ ``rollouts`` (group ``<run>.rollout``); WRITE ``experiences`` and ``results``;
               transactional ids ``<run>.rollout.*`` (one per worker)
``trainer``    READ ``experiences`` (groups ``<run>.trainer*``: fan-out and replay trainers too); WRITE ``sync``
               (published weights, sync requests, the collective group); transactional ids ``<run>.trainer*``
``monitor``    READ ``metrics`` (group ``<run>.monitor``); READ every topic of the run (prefix) and DESCRIBE its
               groups, to count their lag in records (``consumers/lag_gauges.py``, which KEDA scales the
               workers on)
``serve``      WRITE ``experiences`` (feedback); transactional ids ``<run>.serve.*``
``viewer``     READ and DESCRIBE_CONFIGS every topic of the run (prefix), DESCRIBE its groups: Kafka UI,
               ``streamrft topics``, dashboards
=============  ===========================================================================================

The topic grants are derived from ``streamrft.config.topics.TOPIC_KINDS`` (each kind's writers, readers and
dead-letter owners), so a new topic kind brings its ACLs with it. Besides: every role but ``tasks`` and
``viewer`` WRITEs ``metrics``; the roles that follow weights (explorer, rollout, trainer, serve) READ ``sync`` and
``control``; a role that checks a topic's records WRITEs and READs that topic's dead-letter topic (the explorer
owns the dead letters of ``sync`` and ``control``, the workers and servers those of weights they refuse). Topics
are LITERAL patterns (a PREFIXED ``experiences`` would also match ``experiences.dlq``); groups and transactional
ids with one instance per process are PREFIXED.

Why the signals are on two topics: Kafka authorizes a write per topic, never per key, so the trainer's signals
(``sync``) and the explorer's (``control``) are apart, and only the trainer's principal may publish weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import TOPIC_KINDS, RunConfig

ResourceType = Literal["topic", "group", "transactional_id"]
PatternType = Literal["literal", "prefixed"]
Operation = Literal["read", "write", "describe", "describe_configs"]

ROLES = ("tasks", "explorer", "rollout", "trainer", "monitor", "serve", "viewer")


@dataclass(frozen=True, order=True)
class Acl:
    """ALLOW ``principal`` to ``operation`` the resource, from any host."""

    principal: str
    resource: ResourceType
    pattern: PatternType
    name: str
    operation: Operation

    def matches(self, resource: ResourceType, name: str, operation: Operation) -> bool:
        """Whether this ACL allows ``operation`` on that resource (READ and WRITE imply DESCRIBE, as in Kafka)."""
        implied = {self.operation} | ({"describe"} if self.operation in ("read", "write") else set())
        named = name == self.name if self.pattern == "literal" else name.startswith(self.name)
        return self.resource == resource and named and operation in implied

    def kafka_acls_command(self) -> str:
        """The same ACL as Kafka's own tool writes it."""
        return kafka_acls_command(self.principal, self.resource, self.name, self.operation, self.pattern)


def kafka_acls_command(principal: str, resource: ResourceType, name: str, operation: str,
                       pattern: PatternType = "literal") -> str:
    flag = {"topic": "--topic", "group": "--group", "transactional_id": "--transactional-id"}[resource]
    operation_name = "".join(part.capitalize() for part in operation.split("_"))
    prefixed = " --resource-pattern-type prefixed" if pattern == "prefixed" else ""
    return f"kafka-acls --add --allow-principal {principal} --operation {operation_name} {flag} {name}{prefixed}"


def principal_name(config: RunConfig, role: str) -> str:
    """The SCRAM user of ``role`` in this run (its principal is ``User:`` + this)."""
    if role not in ROLES:
        raise KeyError(f"unknown role {role!r}; the roles with principals are {', '.join(ROLES)}")
    return f"{config.name}.{role}"


def role_acls(config: RunConfig, role: str) -> list[Acl]:
    """Every ACL ``role``'s principal needs in this run (see the module docstring)."""
    principal = "User:" + principal_name(config, role)
    topic = config.topic
    grants: list[tuple[ResourceType, PatternType, str, Operation]] = []

    def read(*names: str) -> None:
        grants.extend(("topic", "literal", t, "read") for n in names for t in config.topics_of(n))

    def write(*names: str) -> None:
        grants.extend(("topic", "literal", t, "write") for n in names for t in config.topics_of(n))

    def dead_letters(*names: str) -> None:
        for t in (t for n in names for t in config.topics_of(n)):
            grants.extend([("topic", "literal", config.dlq_topic(t), "write"),
                           ("topic", "literal", config.dlq_topic(t), "read")])

    def group(name: str, operation: Operation = "read", pattern: PatternType = "literal") -> None:
        grants.append(("group", pattern, name, operation))

    def transactional(name: str, pattern: PatternType = "literal") -> None:
        grants.extend([("transactional_id", pattern, name, "write"), ("transactional_id", pattern, name, "describe")])

    for kind in TOPIC_KINDS:
        if role in kind.readers:
            read(kind.name)
        if role in kind.writers:
            write(kind.name)
        if role in kind.dead_letters:
            dead_letters(kind.name)
    if role == "explorer":
        group(config.consumer_group("explorer"))
        grants.append(("topic", "literal", topic("experiences"), "describe"))  # the trainer's lag
        group(config.consumer_group("trainer"), "describe")
        transactional(f"{config.name}.explorer")
    elif role == "rollout":
        group(config.consumer_group("rollout"))
        transactional(f"{config.name}.rollout.", "prefixed")
    elif role == "trainer":
        group(config.consumer_group("trainer"), pattern="prefixed")
        transactional(f"{config.name}.trainer", "prefixed")
    elif role == "monitor":
        group(config.consumer_group("monitor"))
        # lag in records is read, not computed from offsets: the topics from the groups' positions on
        grants.extend([("topic", "prefixed", config.topic_prefix, "read"),
                       ("group", "prefixed", f"{config.name}.", "describe")])
    elif role == "serve":
        transactional(f"{config.name}.serve.", "prefixed")
    elif role == "viewer":
        grants.extend([("topic", "prefixed", config.topic_prefix, "read"),
                       ("topic", "prefixed", config.topic_prefix, "describe_configs"),
                       ("group", "prefixed", f"{config.name}.", "describe")])
    return sorted({Acl(principal, *grant) for grant in grants})


def run_acls(config: RunConfig) -> dict[str, list[Acl]]:
    """role -> its ACLs, for every role of the run."""
    return {role: role_acls(config, role) for role in ROLES}


def allowed_principals(config: RunConfig, resource: ResourceType, name: str, operation: Operation) -> list[str]:
    """The run's principals that its ACLs allow ``operation`` on that resource (for error messages)."""
    return sorted({acl.principal for acls in run_acls(config).values() for acl in acls
                   if acl.matches(resource, name, operation)})


def denial_message(config: RunConfig, operation: Operation, resource: ResourceType | Literal["cluster"], name: str,
                   kafka_error: str) -> str:
    """What to tell a user whose principal Kafka refused: who, what, on what, the ACL that would allow it, and
    who this run's ACLs allow instead."""
    principal = f"User:{config.kafka.sasl_username}" if config.kafka.sasl_username else "User:ANONYMOUS"
    what = f"{operation.upper()} on {resource.replace('_', ' ')} {name}".rstrip()
    text = f"Kafka denied {principal} {what} ({kafka_error})."
    if resource == "cluster":
        return text + " Cluster operations (creating topics, users, ACLs) need an admin principal."
    text += f" The ACL that would allow it: `{kafka_acls_command(principal, resource, name, operation)}`."
    allowed = allowed_principals(config, resource, name, operation)
    if allowed:
        text += f" In this run's ACLs (`streamrft acls`) that is for {', '.join(allowed)}"
        text += "; run each role with its own principal (kafka.sasl_username)." if principal not in allowed else "."
    else:
        text += " No role of this run is allowed that (`streamrft acls` lists what each may do)."
    return text
