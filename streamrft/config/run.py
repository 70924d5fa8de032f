"""The run configuration: composes one section per component, loaded from YAML plus environment overrides."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from streamrft.run_shape import Mode, RunShape

from streamrft.engines.settings.training import TrainingSettings
from streamrft.errors import ConfigError

from .auxiliary import AuxiliaryModelConfig, DistillationConfig, JudgeConfig, check_auxiliary
from .base import Section, explain
from .deprecated import move_keys
from .environment import read_environment
from .kafka import EmbeddedBrokerConfig, KafkaConfig, SchemaRegistryConfig
from .kubernetes import KubernetesConfig
from .limits import LimitsConfig
from .roles import (ExplorerConfig, LaunchConfig, ModelConfig, MonitorConfig, RolloutConfig, ServeConfig,
                    TrainerConfig)
from .sync import SyncConfig
from .topics import TOPIC_NAMES, TopicConfig, TopicsConfig

if TYPE_CHECKING:
    from streamrft.credentials import Credential

class RunConfig(Section):
    """A run: its name, which roles it has, and one section per component."""

    name: str = Field(default="demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="the run's name: its topics' prefix (rft.<name>.), its consumer groups "
                                  "(<name>.<role>) and its directories; a new name is a new run, the same name "
                                  "resumes it")
    topic_prefix_override: str | None = Field(default=None, alias="topic_prefix",
                                              description="prefix of the run's topic names; default rft.<name>.")
    mode: Literal["both", "explore", "train"] = Field(
        default="both", description="the roles the run has (streamrft/run_shape.py): both: explorer, rollout "
                                    "workers and trainer, the explorer paced on the trainer; explore: no trainer "
                                    "(data generation, evaluation of a fixed model), never waiting for one; train: "
                                    "no explorer and no rollout workers, the trainer alone on the supervised "
                                    "experiences in the experiences topic (`streamrft data produce`)")
    metrics_host: str = Field(default="127.0.0.1", min_length=1, pattern=r"^[A-Za-z0-9.:_-]+$",
                              description="address every role's Prometheus endpoint binds (the endpoints have no "
                                          "authentication): loopback by default, 0.0.0.0 for a scraper elsewhere")
    kafka: KafkaConfig = Field(default=KafkaConfig(), description="how every role reaches Kafka: the cluster, "
                                                                  "security and librdkafka properties")
    schema_registry: SchemaRegistryConfig = Field(default=SchemaRegistryConfig(),
                                                  description="an optional schema registry the records are framed "
                                                              "through")
    topics: TopicsConfig = Field(default=TopicsConfig(), description="each topic's layout (partitions, "
                                                                     "replication, retention)")
    broker: EmbeddedBrokerConfig = Field(default=EmbeddedBrokerConfig(),
                                         description="the embedded broker started when kafka.bootstrap_servers is "
                                                     "empty")
    model: ModelConfig = Field(default=ModelConfig(), description="the policy being trained")
    sync: SyncConfig = Field(default=SyncConfig(), description="the sync policy: how often weights are published "
                                                               "and how far the explorer may run ahead of them")
    explorer: ExplorerConfig = Field(default=ExplorerConfig(), description="the explorer: steps, evaluation, the "
                                                                           "tasks' order")
    rollout: RolloutConfig = Field(default=RolloutConfig(), description="the rollout workers: inference engine, "
                                                                        "sampling, weight updates")
    trainer: TrainerConfig = Field(default=TrainerConfig(), description="the trainer: optimiser, algorithm, "
                                                                        "checkpoints, weight publishing")
    monitor: MonitorConfig = Field(default=MonitorConfig(), description="the monitor: metric files, Prometheus, "
                                                                        "experiment trackers")
    serve: ServeConfig = Field(default=ServeConfig(), description="`streamrft serve`: the OpenAI-compatible server "
                                                                  "whose rated completions become experiences")
    launch: LaunchConfig = Field(default=LaunchConfig(), description="what `streamrft run` starts on this machine")
    limits: LimitsConfig = Field(default=LimitsConfig(), description="caps on what one record may ask of the run")
    kubernetes: KubernetesConfig = Field(default=KubernetesConfig(),
                                         description="how `streamrft k8s` lays the run out on a cluster")
    auxiliary_models: dict[str, AuxiliaryModelConfig] = Field(
        default_factory=dict, description="models beside the rollout model, by name: a judge, a teacher")
    judge: JudgeConfig | None = Field(default=None, description="how reward_fn judge asks its model; none: the "
                                                               "defaults, with the auxiliary model named judge")
    distillation: DistillationConfig = Field(default=DistillationConfig(),
                                             description="on-policy distillation from a teacher among "
                                                         "auxiliary_models")

    model_config = Section.model_config | {"populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        return move_keys(data)

    @field_validator("topic_prefix_override")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        if value is not None and not all(c.isalnum() or c in "._-" for c in value):
            raise ValueError("topic_prefix may only contain letters, digits, '.', '_' and '-'")
        return value

    @model_validator(mode="after")
    def _auxiliary_models_agree(self) -> "RunConfig":
        check_auxiliary(self.auxiliary_models, self.judge, self.distillation, self.rollout.engine,
                        self.rollout.vllm.gpu_memory_utilization, self.trainer.algorithm.uses_teacher)
        return self

    @model_validator(mode="after")
    def _roles_agree(self) -> "RunConfig":
        explorer, trainer = self.explorer, self.trainer
        if trainer.train_batch_size is not None and trainer.train_batch_size % explorer.repeat_times:
            raise ValueError(
                f"trainer.train_batch_size ({trainer.train_batch_size}) must be a multiple of "
                f"explorer.repeat_times ({explorer.repeat_times}): the trainer takes whole groups"
            )
        sampling = self.rollout.sampling
        if self.rollout.engine == "vllm" and (sampling.top_k > 0 or sampling.top_p < 1):
            raise ValueError(
                "rollout.engine: vllm reports logprobs after top-k/top-p renormalisation, which the trainer "
                f"cannot reproduce; set rollout.sampling.top_k: 0 and top_p: 1.0 (got {sampling.top_k}, "
                f"{sampling.top_p}), or use engine: transformers")
        if self.rollout.engine == "openai":
            remote = self.rollout.openai
            if not remote.base_url.startswith(("http://", "https://")) or not remote.model:
                raise ValueError("rollout.engine: openai needs rollout.openai.base_url (http(s)://host:port/v1) "
                                 "and rollout.openai.model (the model id the endpoint serves)")
            if sampling.top_k > 0:
                raise ValueError("rollout.engine: openai cannot sample with top_k (the OpenAI API has no such "
                                 "parameter); set rollout.sampling.top_k: 0")
        partitions, wanted = self.topics.rollouts.partitions, self.kubernetes.rollout_max_replicas
        if wanted is not None and wanted > partitions:
            raise ValueError(
                f"kubernetes.rollout_max_replicas ({wanted}) is more than topics.rollouts.partitions "
                f"({partitions}): a rollout worker beyond the partition count gets no work; raise the partitions "
                "or lower the replicas")
        _ = self.shape  # RunShape refuses what no run can be (trainer.mix in mode train)
        if explorer.eval_interval is not None and not explorer.eval_tasksets:
            raise ValueError("explorer.eval_interval is set but explorer.eval_tasksets is empty; add a taskset "
                             "or remove eval_interval")
        if explorer.eval_on_start and not explorer.eval_tasksets:
            raise ValueError("explorer.eval_on_start is set but explorer.eval_tasksets is empty; add a taskset "
                             "or remove eval_on_start")
        secured = self.kafka.authenticated or (self.kafka.embedded and self.broker.security != "none")
        if secured and "." in self.name:
            raise ValueError(f"name {self.name!r}: on a secured cluster a run's name has no '.', or the prefixed "
                             f"ACLs of run 'a' (rft.a., a.trainer...) would also match a run named 'a.b'; use '-' "
                             "or '_' instead")
        return self

    @property
    def shape(self) -> RunShape:
        """Which roles the run has and what its trainer reads."""
        return RunShape(Mode(self.mode), mixes_supervised=self.trainer.mix.active)

    @property
    def train_batch_size(self) -> int:
        """Experiences per trainer step (whole groups)."""
        return self.trainer.train_batch_size or self.explorer.batch_size * self.explorer.repeat_times

    @property
    def training_settings(self) -> TrainingSettings:
        """The training engine's settings: the trainer's optimiser keys and its algorithm, with the rollout's
        sampling temperature (the loss divides logits by it, as the engine did when it computed the behaviour
        logprobs; greedy rollouts, T = 0, report T = 1 logprobs)."""
        temperature = self.rollout.sampling.temperature or 1.0
        return TrainingSettings.of(self.trainer, self.trainer.algorithm, temperature=temperature)

    @property
    def groups_per_train_step(self) -> int:
        return self.train_batch_size // self.explorer.repeat_times

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.trainer.checkpoint_dir.format(name=self.name))

    @property
    def checkpoint_url(self) -> str:
        """``trainer.checkpoint_dir`` as written (a local path, or an ``s3://`` URL that ``checkpoint_dir``,
        a local Path, cannot stand for)."""
        return self.trainer.checkpoint_dir.format(name=self.name)

    @property
    def weights_url(self) -> str:
        return self.trainer.weights.url or (self.checkpoint_dir.parent / "weights").resolve().as_uri()

    @property
    def output_dir(self) -> Path:
        return Path(self.monitor.output_dir.format(name=self.name))

    @property
    def topic_prefix(self) -> str:
        return self.topic_prefix_override if self.topic_prefix_override is not None else f"rft.{self.name}."

    def topic(self, name: str) -> str:
        """Full name of one of the run's topics (``tasks``, ``experiences``, ...)."""
        if name not in TOPIC_NAMES:
            raise KeyError(f"unknown topic {name!r}; the run's topics are {', '.join(TOPIC_NAMES)}")
        return self.topic_prefix + name

    def dlq_topic(self, source_topic: str) -> str:
        return f"{source_topic}.dlq"

    def topics_of(self, name: str) -> list[str]:
        """Full names of the topics of kind ``name``: its topic, and for ``tasks`` also the topics of the
        tasksets fed through topics of their own (``tasks.<name>``, ``explorer.tasksets``)."""
        own = [self.topic(name)]
        if name == "tasks":
            own += [self.topic_prefix + t.topic_suffix for t in self.explorer.tasksets
                    if t.topic_suffix not in (None, "tasks")]
        return own

    def topic_layouts(self) -> dict[str, TopicConfig]:
        """Every topic of the run (full name -> layout): each kind's topics and their dead-letter topics."""
        out = {}
        for name in TOPIC_NAMES:
            for topic in self.topics_of(name):
                out[topic] = getattr(self.topics, name)
                out[self.dlq_topic(topic)] = self.topics.dlq
        return out

    def consumer_group(self, role: str) -> str:
        """Kafka consumer group id of a role, e.g. ``<run>.trainer``."""
        return f"{self.name}.{role}"

    def on_cluster(self, bootstrap: str, credential: "Credential | None" = None) -> "RunConfig":
        """This config pointed at ``bootstrap``; with ``credential`` (a secured embedded broker's admin) as its
        principal unless it names one of its own."""
        kafka = {**self.kafka.model_dump(), "bootstrap_servers": bootstrap}
        if credential is not None and not self.kafka.sasl_username:
            kafka.update(credential.kafka_settings(), credentials_file=None)
        return self.model_copy(update={"kafka": KafkaConfig.model_validate(kafka)})


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """The run config keys set by ``STREAMRFT_<SECTION>__<KEY>`` variables in ``env`` (see
    :mod:`streamrft.config.environment`), nested as in the YAML file and not yet validated."""
    return read_environment(env, RunConfig)


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load a run config: YAML file (optional) <- environment (STREAMRFT_...) <- explicit overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}; check the path") from exc
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of settings at the top level, not {type(raw).__name__}")
    raw = _merge(raw, env_overrides(os.environ if env is None else env))
    raw = _merge(raw, overrides or {})
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise explain(exc, source, RunConfig) from None
