"""Configuration: one frozen pydantic model per component, composed by RunConfig."""
from .base import Section
from .kafka import EmbeddedBrokerConfig, KafkaConfig, SchemaRegistryConfig, TopicConfig, TopicsConfig
from .run import TOPIC_NAMES, RunConfig, env_overrides, load_config

__all__ = [
    "Section",
    "EmbeddedBrokerConfig",
    "KafkaConfig",
    "SchemaRegistryConfig",
    "TopicConfig",
    "TopicsConfig",
    "TOPIC_NAMES",
    "RunConfig",
    "env_overrides",
    "load_config",
]
