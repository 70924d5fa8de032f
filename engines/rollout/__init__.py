"""Rollout without Kafka: requests in, finished requests out, on one engine (:mod:`.core`, which carries out the
plans of :mod:`.scheduler`), and what a finished request becomes (:mod:`.assembly`, its training rewards shaped
by :mod:`.reward_shaping` first)."""
from .assembly import Assembled, assemble
from .core import Done, RolloutCore, Weights
from .reward_shaping import OverlongShaping
from .scheduler import Plan, RolloutPolicy, RolloutScheduler, SchedulerState, Verdict, VersionWait, WeightsState

__all__ = ["Assembled", "Done", "OverlongShaping", "Plan", "RolloutCore", "RolloutPolicy", "RolloutScheduler",
           "SchedulerState", "Verdict", "VersionWait", "Weights", "WeightsState", "assemble"]
