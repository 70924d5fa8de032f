"""Rollout without Kafka: requests in, finished requests out, on one engine (:mod:`.core`)."""
from .core import Done, RolloutCore, RolloutPolicy, Weights

__all__ = ["Done", "RolloutCore", "RolloutPolicy", "Weights"]
