"""Configuration: defaults, environment overrides, and errors that name the key, the value and the fix."""
from __future__ import annotations

import pytest

from streamrft.config import load_config
from streamrft.errors import ConfigError


def test_defaults_describe_the_embedded_run():
    config = load_config(env={})
    assert config.kafka.embedded
    assert config.topic("experiences") == "rft.demo.experiences"
    assert config.group("rollout") == "demo.rollout"
    assert config.topics.sync.cleanup_policy == "compact,delete"
    assert config.topics.experiences.max_message_bytes == 16 * 1024 * 1024


def test_yaml_file_and_topic_prefix(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: exp1\ntopic_prefix: team-a.exp1.\ntopics:\n  rollouts:\n    partitions: 32\n")
    config = load_config(path, env={})
    assert config.topic("tasks") == "team-a.exp1.tasks"
    assert config.topics.rollouts.partitions == 32


def test_environment_overrides_nested_keys_with_types():
    env = {
        "STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": "broker:9092",
        "STREAMRFT_TOPICS__RESULTS__PARTITIONS": "12",
        "STREAMRFT_LOG_LEVEL": "DEBUG",  # not a config section: ignored
        "OTHER": "x",
    }
    config = load_config(env=env)
    assert config.kafka.bootstrap_servers == "broker:9092"
    assert not config.kafka.embedded
    assert config.topics.results.partitions == 12


def test_explicit_overrides_win_over_environment():
    config = load_config(overrides={"name": "b"}, env={"STREAMRFT_NAME": "a"})
    assert config.name == "b"


def test_unknown_key_is_named_with_a_fix():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"kafka": {"bootstrap_server": "x:1"}}, env={})
    message = str(info.value)
    assert "kafka.bootstrap_server = 'x:1'" in message
    assert "unknown key" in message


def test_bad_values_name_key_value_and_fix():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"topics": {"sync": {"partitions": 4}, "rollouts": {"partitions": 0}}}, env={})
    message = str(info.value)
    assert "topics.rollouts.partitions = 0" in message
    assert "greater than or equal to 1" in message
    assert "topics.sync" in message and "must be 1" in message


def test_sasl_needs_credentials_and_hides_the_password():
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        load_config(overrides={"kafka": {"security_protocol": "SASL_SSL"}}, env={})
    config = load_config(
        overrides={"kafka": {"bootstrap_servers": "h:9093", "security_protocol": "SASL_SSL",
                             "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u"}},
        env={"STREAMRFT_KAFKA__SASL_PASSWORD": "s3cret"},
    )
    assert "s3cret" not in repr(config)
    assert config.kafka.client_properties("h:9093")["sasl.password"] == "s3cret"


def test_config_is_frozen():
    config = load_config(env={})
    with pytest.raises(Exception):
        config.name = "other"


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy, env={})


def test_schema_registry_url_is_checked():
    with pytest.raises(ConfigError, match="schema_registry.url"):
        load_config(overrides={"schema_registry": {"url": "registry:8081"}}, env={})
    assert load_config(overrides={"schema_registry": {"url": "http://registry:8081"}}, env={}).schema_registry.enabled


def test_trainer_mixed_precision_reaches_the_engine_and_bad_values_are_named():
    from streamrft.consumers.trainer import training_settings

    assert training_settings(load_config(overrides={})).mixed_precision == "auto"
    assert training_settings(load_config(overrides={"trainer": {"mixed_precision": "bf16"}})).mixed_precision == "bf16"
    with pytest.raises(ConfigError, match="trainer.mixed_precision"):
        load_config(overrides={"trainer": {"mixed_precision": "fp8"}})
