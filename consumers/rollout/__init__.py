"""The rollout worker: one member of the ``<run>.rollout`` consumer group, the Kafka side of the rollout core
(:mod:`streamrft.engines.rollout`). The role is :class:`RolloutWorker` (``role.py``); beside it the request
ledger of its commit points (``ledger.py``), its auxiliary models (``auxiliary.py``) and what its engine and core
are built from (``engine_setup.py``)."""
from .engine_setup import build_engine, request_sampling, rollout_policy
from .role import RolloutWorker

__all__ = ["RolloutWorker", "build_engine", "request_sampling", "rollout_policy"]
