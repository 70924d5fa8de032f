"""Configuration: defaults, environment overrides, and errors that name the key, the value and the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from streamrft.config import load_config
from streamrft.errors import ConfigError


def test_defaults_describe_the_embedded_run():
    config = load_config(env={})
    assert config.kafka.embedded
    assert config.topic("experiences") == "rft.demo.experiences"
    assert config.consumer_group("rollout") == "demo.rollout"
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
    embedded = load_config(overrides={"schema_registry": {"url": "embedded"}}, env={}).schema_registry
    assert embedded.enabled and embedded.embedded and embedded.compatibility == "BACKWARD"
    with pytest.raises(ConfigError, match="embedded_heap"):
        load_config(overrides={"schema_registry": {"url": "embedded", "embedded_heap": "lots"}}, env={})


def test_trainer_mixed_precision_reaches_the_engine_and_bad_values_are_named():
    assert load_config(overrides={}, env={}).training_settings.mixed_precision == "auto"
    bf16 = load_config(overrides={"trainer": {"mixed_precision": "bf16"}}, env={})
    assert bf16.training_settings.mixed_precision == "bf16"
    with pytest.raises(ConfigError, match="trainer.mixed_precision"):
        load_config(overrides={"trainer": {"mixed_precision": "fp8"}}, env={})


# ----------------------------------------------------------------------------- environment and secrets
SASL = {"kafka": {"bootstrap_servers": "h:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
                  "sasl_username": "u"}}


def test_a_numeric_password_from_the_environment_stays_the_string_it_was():
    config = load_config(overrides=SASL, env={"STREAMRFT_KAFKA__SASL_PASSWORD": "0123456"})
    assert config.kafka.sasl_password.get_secret_value() == "0123456"  # not the int 123456


def test_secrets_never_appear_in_config_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("kafka:\n  sasl_password: 987654\n"  # a secret of the wrong type: the error is about it
                    "  sasl_pasword: hunter2-typo\n"  # a misspelt secret key
                    "  producer: {sasl.password: [hunter3]}\n"  # a librdkafka secret passed through
                    "schema_registry:\n  basic_auth_user_info: [user, hunter4]\n"  # nested, wrong type
                    "topics:\n  rollouts: {partitions: 0}\n")  # and an ordinary mistake, still explained
    with pytest.raises(ConfigError) as info:
        load_config(path, env={"STREAMRFT_SCHEMA_REGISTRY__URL": "nope"})
    message = str(info.value)
    for secret in ("987654", "hunter2", "hunter3", "hunter4"):
        assert secret not in message
    for key in ("kafka.sasl_password:", "kafka.sasl_pasword:", "schema_registry.basic_auth_user_info:",
                "schema_registry.url = 'nope'", "topics.rollouts.partitions = 0"):
        assert key in message


def test_a_valid_secret_is_not_shown_by_an_error_elsewhere():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=SASL | {"name": "bad name"}, env={"STREAMRFT_KAFKA__SASL_PASSWORD": "s3cret-42"})
    assert "name = 'bad name'" in str(info.value) and "s3cret-42" not in str(info.value)


def test_unknown_environment_key_under_a_known_section_is_named():
    with pytest.raises(ConfigError, match=r"trainer\.lr_shedule = 'constant': unknown key"):
        load_config(env={"STREAMRFT_TRAINER__LR_SHEDULE": "constant"})
    with pytest.raises(ConfigError, match=r"topics\.results\.partitons"):
        load_config(env={"STREAMRFT_TOPICS__RESULTS__PARTITONS": "3"})


def test_environment_values_null_json_and_the_top_level_alias():
    config = load_config(env={"STREAMRFT_TRAINER__MAX_GRAD_NORM": "null", "STREAMRFT_TOPIC_PREFIX": "team.x.",
                              "STREAMRFT_KAFKA__PRODUCER": '{"linger.ms": 5}',
                              "STREAMRFT_MONITOR__TENSORBOARD": "false", "TOPIC_PREFIX": "not ours"})
    assert config.trainer.max_grad_norm is None
    assert config.topic_prefix == "team.x."
    assert config.kafka.producer == {"linger.ms": 5}
    assert config.monitor.tensorboard is False
    with pytest.raises(ConfigError, match="must be JSON"):
        load_config(env={"STREAMRFT_KAFKA__PRODUCER": "linger.ms: 5"})


def test_file_then_environment_then_explicit_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: from-file\ntrainer: {lr: 1.0e-5, save_interval: 3}\nexplorer: {batch_size: 2}\n")
    env = {"STREAMRFT_TRAINER__LR": "2e-6", "STREAMRFT_NAME": "from-env"}
    config = load_config(path, overrides={"name": "explicit"}, env=env)
    assert (config.name, config.trainer.lr, config.trainer.save_interval, config.explorer.batch_size) == \
        ("explicit", 2e-6, 3, 2)


def test_metrics_host_is_loopback_unless_set():
    assert load_config(env={}).metrics_host == "127.0.0.1"
    assert load_config(env={"STREAMRFT_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"
    with pytest.raises(ConfigError, match="metrics_host"):
        load_config(overrides={"metrics_host": "http://x"}, env={})


def test_limits_section_is_set_from_the_environment_like_any_other():
    env = {"STREAMRFT_LIMITS__MAX_TURNS": "8", "STREAMRFT_LIMITS__MAX_VERSION_WAIT_S": "30.5"}
    limits = load_config(env=env).limits
    assert (limits.max_turns, limits.max_version_wait_s) == (8, 30.5)
    with pytest.raises(ConfigError, match=r"limits\.max_turnz = '8': unknown key"):
        load_config(env={"STREAMRFT_LIMITS__MAX_TURNZ": "8"})
    with pytest.raises(ConfigError, match=r"limits\.max_turns = '0'"):
        load_config(env={"STREAMRFT_LIMITS__MAX_TURNS": "0"})


# ----------------------------------------------------------------------------- training knobs, declared once
# A value other than the default for every knob of the engine's settings that a run's YAML sets.
KNOB_VALUES = {
    "lr": 3e-5, "weight_decay": 0.01, "betas": [0.8, 0.95], "adam_eps": 1e-6, "max_grad_norm": None,
    "lr_schedule": "warmup_cosine", "warmup_steps": 2, "total_steps": 20, "min_lr_ratio": 0.1, "micro_batch_size": 3,
    "mixed_precision": "no", "gradient_checkpointing": True,
    "max_tokens_per_micro_batch": 4096, "pack_sequences": True, "attn_implementation": "eager",
    "critic": {"model_path": "critic-dir", "lr": 2e-5, "weight_decay": 0.0, "max_grad_norm": 0.5,
               "lr_schedule": "warmup_cosine", "warmup_steps": 1, "total_steps": 30, "min_lr_ratio": 0.2,
               "cliprange_value": 0.2, "critic_warmup": 3},
}
ALGORITHM_VALUES = {
    "advantage": "gae", "advantage_params": {"whiten": False}, "gae_gamma": 0.99, "gae_lambda": 0.95,
    "gigpo_step_weight": 0.5,
    "policy_loss": "sapo",
    "policy_loss_params": {"tau_pos": 0.5}, "clip_low": 0.1, "clip_high": 0.3, "clip_ratio_c": None,  # ppo_clip's
    "loss_agg": "seq-mean-token-sum", "entropy_coef": 0.01, "kl_coef": 0.05, "kl_estimator": "k2",
    "kl_penalty_coef": 0.02, "kl_penalty_estimator": "k3", "kl_ctrl": "adaptive", "target_kl": 0.05,
    "kl_horizon": 500, "recompute_old_logprobs": False, "tis": True, "is_correction": "seq_mis", "tis_cap": 3.0,
    "is_mask_low": 0.2, "is_mask_high": 3.0, "mask_truncated": True, "distill_coef": 0.5, "preference_loss": "ipo",
    "dpo_beta": 0.2, "sft_loss": "sft_phi", "mix_weighting": "chord", "chord_mu_peak": 0.5, "chord_mu_valley": 0.05,
    "chord_mu_warmup_steps": 3, "chord_mu_decay_steps": 7,
}


def test_every_training_knob_is_settable_from_yaml_and_reaches_the_engine(tmp_path):
    from streamrft.engines.training import TrainingSettings

    settable = set(TrainingSettings.model_fields) - {"temperature"}  # temperature: from rollout.sampling
    assert settable == set(KNOB_VALUES) | set(ALGORITHM_VALUES), "give a new knob a value in this test"
    path = tmp_path / "run.yaml"
    # mix_weighting: chord weighs SFT rows, which trainer.mix brings
    path.write_text(yaml.safe_dump({"trainer": KNOB_VALUES | {"algorithm": ALGORITHM_VALUES, "mix": {"sft": 0.1}},
                                    "rollout": {"sampling": {"temperature": 0.7}},
                                    # distill_coef trains on a teacher's logprobs: the run names its teacher
                                    "auxiliary_models": {"teacher": {"model": "teacher-dir"}},
                                    "distillation": {"teacher": "teacher"}}))
    settings = load_config(path, env={}).training_settings
    for key, value in (KNOB_VALUES | ALGORITHM_VALUES).items():
        got = getattr(settings, key)
        got = got.model_dump() if hasattr(got, "model_dump") else got  # a section of its own (trainer.critic)
        assert got == (tuple(value) if isinstance(value, list) else value), key
    assert settings.temperature == 0.7


def test_defaults_agree_between_the_run_config_and_the_engine():
    from streamrft.engines.training import TrainingSettings

    assert load_config(env={}).training_settings == TrainingSettings()
    assert load_config(env={}).trainer.micro_batch_size == TrainingSettings().micro_batch_size
    greedy = load_config(overrides={"rollout": {"sampling": {"temperature": 0}}}, env={})
    assert greedy.training_settings.temperature == 1.0  # greedy rollouts report T = 1 logprobs


@pytest.mark.parametrize("key", ["advantage", "policy_loss", "loss_agg", "kl_estimator", "kl_penalty_estimator"])
def test_algorithm_names_are_checked_at_load_against_the_registries(key):
    from streamrft.engines import algorithms

    registry = {"advantage": algorithms.ADVANTAGES, "policy_loss": algorithms.POLICY_LOSSES,
                "loss_agg": algorithms.LOSS_AGGREGATIONS}.get(key, algorithms.KL_ESTIMATORS)
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"trainer": {"algorithm": {key: "nope"}}}, env={})
    message = str(info.value)
    assert f"trainer.algorithm.{key} = 'nope'" in message
    assert ", ".join(registry.names()) in message


def test_a_plugin_algorithm_is_accepted_without_a_core_edit(monkeypatch):
    from importlib.metadata import EntryPoint

    from streamrft.engines.algorithms import ADVANTAGES, registry

    plugin = EntryPoint("my_baseline", "streamrft.engines.algorithms.advantages:dr_grpo", "streamrft.advantages")

    def fake_entry_points(group: str, name: str | None = None):
        return [ep for ep in (plugin,) if ep.group == group and name in (None, ep.name)]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    config = load_config(overrides={"trainer": {"algorithm": {"advantage": "my_baseline"}}}, env={})
    assert config.training_settings.advantage == "my_baseline"
    assert "my_baseline" in ADVANTAGES.names()


def test_training_knob_mistakes_fail_at_load_with_the_key():
    with pytest.raises(ConfigError, match=r"trainer: lr_schedule=warmup_cosine needs total_steps \(None\)"):
        load_config(overrides={"trainer": {"lr_schedule": "warmup_cosine"}}, env={})
    with pytest.raises(ConfigError, match=r"trainer.algorithm: advantage_params \['gama'\] .* takes epsilon"):
        load_config(overrides={"trainer": {"algorithm": {"advantage_params": {"gama": 1}}}}, env={})
    with pytest.raises(ConfigError, match=r"trainer: betas must both be in \[0, 1\)"):
        load_config(overrides={"trainer": {"betas": [0.9, 1.5]}}, env={})


def test_the_staleness_policy_that_keeps_stale_experiences_is_importance_weight():
    """'correct' means a right answer everywhere else; the policy's old name still loads, as its new one."""
    assert load_config(overrides={"trainer": {"staleness_policy": "correct"}}, env={}).trainer.staleness_policy \
        == "importance_weight"
    assert load_config(overrides={"trainer": {"staleness_policy": "importance_weight"}},
                       env={}).trainer.staleness_policy == "importance_weight"


def test_a_topic_override_keeps_that_topics_other_defaults():
    from streamrft.config import load_config

    config = load_config(overrides={"topics": {"sync": {"replication_factor": 3}, "rollouts": {"retention_ms": 1}}},
                         env={})
    assert config.topics.sync.replication_factor == 3 and config.topics.sync.cleanup_policy == "compact,delete"
    assert config.topics.rollouts.partitions == 16 and config.topics.rollouts.retention_ms == 1


@pytest.mark.parametrize("example", sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml")),
                         ids=lambda path: path.name)
def test_every_example_loads_and_its_task_files_become_tasks_of_known_workflows(example: Path, monkeypatch):
    from streamrft.engines.workflows import get_workflow_class
    from streamrft.producers.task_files import FieldMapping, Rejected, read_tasks

    monkeypatch.chdir(example.parents[1])  # the examples name their files from the repository root
    config = load_config(example, env={})
    files = [*config.launch.task_files, *config.explorer.eval_tasksets]
    assert files
    for task_file in files:
        tasks = list(read_tasks(task_file.path, FieldMapping.from_task_file(task_file)))
        assert tasks and not [t for t in tasks if isinstance(t, Rejected)]
        assert get_workflow_class(task_file.workflow) is not None
