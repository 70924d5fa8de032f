"""Configuration: one frozen pydantic model per component, composed by RunConfig."""
from .base import Section
from .kafka import EmbeddedBrokerConfig, KafkaConfig, SchemaRegistryConfig
from .topics import TOPIC_KINDS, TOPIC_NAMES, TopicConfig, TopicKind, TopicsConfig
from .roles import (
    AlgorithmConfig,
    EvalTaskset,
    ExplorerConfig,
    LaunchConfig,
    ModelConfig,
    MonitorConfig,
    OverRolloutConfig,
    RolloutConfig,
    SamplingConfig,
    SelectorConfig,
    TaskFile,
    TrainerConfig,
    WeightSyncConfig,
)
from .run import RunConfig, env_overrides, load_config
from .tasksets import DEFAULT_TASKSET, TasksetConfig, TasksetOrder

__all__ = [
    "AlgorithmConfig",
    "EvalTaskset",
    "ExplorerConfig",
    "LaunchConfig",
    "TaskFile",
    "TasksetConfig",
    "TasksetOrder",
    "DEFAULT_TASKSET",
    "ModelConfig",
    "MonitorConfig",
    "OverRolloutConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SelectorConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "Section",
    "EmbeddedBrokerConfig",
    "KafkaConfig",
    "SchemaRegistryConfig",
    "TopicConfig",
    "TopicsConfig",
    "TOPIC_KINDS",
    "TOPIC_NAMES",
    "TopicKind",
    "RunConfig",
    "env_overrides",
    "load_config",
]
