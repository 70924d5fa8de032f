"""Rollout without Kafka: requests in, finished requests out, on one engine (:mod:`.core`, which carries out the
plans of :mod:`.scheduler`), and what a finished request becomes (:mod:`.assembly`)."""
from .assembly import Assembled, assemble
from .core import Done, RolloutCore, Weights
from .scheduler import Plan, RolloutPolicy, RolloutScheduler, SchedulerState, Verdict, VersionWait, WeightsState

__all__ = ["Assembled", "Done", "Plan", "RolloutCore", "RolloutPolicy", "RolloutScheduler", "SchedulerState",
           "Verdict", "VersionWait", "Weights", "WeightsState", "assemble"]
