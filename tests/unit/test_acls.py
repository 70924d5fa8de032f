"""The ACLs a run's principals get (streamrft/acls.py), without a broker: who may write what, runs kept apart,
and the message a refusal gets. tests/integration/test_security.py runs the loop with exactly these ACLs."""
from __future__ import annotations

import pytest

from streamrft.acls import ROLES, allowed_principals, denial_message, principal_name, role_acls, run_acls
from streamrft.config import TOPIC_NAMES, load_config
from streamrft.errors import ConfigError


def config(name: str = "r", **kafka):
    return load_config(overrides={"name": name, "kafka": kafka} if kafka else {"name": name}, env={})


def writers(run, topic: str) -> list[str]:
    return allowed_principals(run, "topic", run.topic(topic), "write")


def test_each_topic_has_the_writers_its_records_promise():
    run = config()
    assert writers(run, "sync") == ["User:r.trainer"]  # only the trainer publishes weights
    assert writers(run, "control") == ["User:r.explorer"]  # only the explorer writes its state and cancels
    assert writers(run, "tasks") == ["User:r.tasks"]
    assert writers(run, "rollouts") == ["User:r.explorer"]
    assert writers(run, "experiences") == ["User:r.rollout", "User:r.serve"]
    assert writers(run, "results") == ["User:r.rollout"]
    assert len(writers(run, "metrics")) == len(ROLES) - 2  # every role but tasks and viewer
    assert allowed_principals(run, "topic", run.topic("experiences"), "read") == ["User:r.monitor", "User:r.trainer",
                                                                                   "User:r.viewer"]
    assert allowed_principals(run, "group", "r.rollout", "read") == ["User:r.rollout"]
    assert allowed_principals(run, "group", "r.trainer-replay", "read") == ["User:r.trainer"]  # fan-out trainers
    assert allowed_principals(run, "transactional_id", "r.rollout.w7", "write") == ["User:r.rollout"]


def test_a_task_producer_may_only_write_tasks():
    (acl,) = role_acls(config(), "tasks")
    assert (acl.resource, acl.pattern, acl.name, acl.operation) == ("topic", "literal", "rft.r.tasks", "write")


def test_topics_are_literal_and_no_acl_of_one_run_matches_another_runs_resources():
    a, b = config("a"), config("ab")
    for role, acls in run_acls(a).items():
        for acl in acls:
            assert acl.pattern == "literal" or acl.resource != "topic" or role in ("viewer", "monitor"), acl
    for acl in (acl for acls in run_acls(a).values() for acl in acls):
        for name in TOPIC_NAMES:
            assert not acl.matches("topic", b.topic(name), acl.operation)
            assert not acl.matches("topic", b.dlq_topic(b.topic(name)), acl.operation)
        for role in ("explorer", "rollout", "trainer", "monitor"):
            assert not acl.matches("group", b.consumer_group(role), acl.operation)


def test_a_dot_in_a_run_name_is_refused_on_a_secured_cluster():
    # run "a"'s prefixes (rft.a., a.trainer) would match a run named "a.b"
    with pytest.raises(ConfigError, match="has no '.'"):
        load_config(overrides={"name": "a.b", "broker": {"security": "sasl_scram"}}, env={})
    with pytest.raises(ConfigError, match="has no '.'"):
        config("a.b", bootstrap_servers="k:9092", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
               sasl_username="u", sasl_password="p")
    assert config("a.b").name == "a.b"  # fine without security


def test_a_refusal_says_who_what_the_acl_that_would_allow_it_and_who_has_it():
    run = config("r", bootstrap_servers="k:9092", security_protocol="SASL_PLAINTEXT",
                 sasl_mechanism="SCRAM-SHA-512", sasl_username=principal_name(config(), "tasks"), sasl_password="p")
    message = denial_message(run, "write", "topic", "rft.r.sync", "TOPIC_AUTHORIZATION_FAILED")
    assert message == (
        "Kafka denied User:r.tasks WRITE on topic rft.r.sync (TOPIC_AUTHORIZATION_FAILED). The ACL that would "
        "allow it: `kafka-acls --add --allow-principal User:r.tasks --operation Write --topic rft.r.sync`. In this "
        "run's ACLs (`streamrft acls`) that is for User:r.trainer; run each role with its own principal "
        "(kafka.sasl_username).")
    other = denial_message(run, "read", "group", "x.rollout", "GROUP_AUTHORIZATION_FAILED")
    assert "No role of this run is allowed that" in other and "--group x.rollout" in other
