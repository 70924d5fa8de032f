"""Configuration: one frozen pydantic model per component, composed by RunConfig.

The names below are imported from their modules when first used, so a command that needs one section (the topic
names for ``--help``) does not build every model of the run config."""
from __future__ import annotations

import importlib

_HOMES = {
    "Section": "base",
    **dict.fromkeys(("EmbeddedBrokerConfig", "KafkaConfig", "SchemaRegistryConfig"), "kafka"),
    **dict.fromkeys(("TOPIC_KINDS", "TOPIC_NAMES", "TopicConfig", "TopicKind", "TopicsConfig"), "topics"),
    **dict.fromkeys(("AlgorithmConfig", "EvalTaskset", "ExplorerConfig", "LaunchConfig", "ModelConfig",
                     "MonitorConfig", "OverRolloutConfig", "RolloutConfig", "SamplingConfig", "SelectorConfig",
                     "TaskFile", "TrainerConfig", "WeightSyncConfig"), "roles"),
    **dict.fromkeys(("RunConfig", "env_overrides", "load_config"), "run"),
    **dict.fromkeys(("DEFAULT_TASKSET", "TasksetConfig", "TasksetOrder"), "tasksets"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value
