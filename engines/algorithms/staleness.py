"""The staleness bound on the trainer side: what to do with experiences sampled by an old policy.

An experience is *stale* when ``model_version < current_version − max_staleness``. Policy ``drop`` removes it
(and counts it); ``importance_weight`` keeps it and marks it for truncated importance-sampling correction
(:mod:`.importance`) against the current policy.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar


class StalenessPolicy(StrEnum):
    DROP = "drop"
    IMPORTANCE_WEIGHT = "importance_weight"


class _Versioned(Protocol):
    model_version: int


E = TypeVar("E", bound=_Versioned)


@dataclass(frozen=True)
class StalenessDecision(Generic[E]):
    kept: list[E]
    needs_correction: list[bool]  # aligned with ``kept``: True = apply importance correction to this experience
    dropped: int
    stale: int  # stale experiences seen (dropped or marked for correction)
    max_lag: int  # largest ``current_version − model_version`` seen (0 if none older)

    def metrics(self, prefix: str = "trainer/staleness_") -> dict[str, float]:
        return {f"{prefix}dropped": self.dropped, f"{prefix}stale": self.stale, f"{prefix}max_lag": self.max_lag}


def is_stale(model_version: int, current_version: int, max_staleness: int) -> bool:
    """``model_version < current_version − max_staleness``."""
    return model_version < current_version - max_staleness


def apply_staleness(
    experiences: Sequence[E],
    current_version: int,
    max_staleness: int,
    policy: StalenessPolicy | str = StalenessPolicy.DROP,
) -> StalenessDecision[E]:
    """Split ``experiences`` by the staleness bound; see the module docstring."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    policy = StalenessPolicy(policy)
    kept: list[E] = []
    needs_correction: list[bool] = []
    dropped = stale = max_lag = 0
    for exp in experiences:
        max_lag = max(max_lag, current_version - exp.model_version)
        if not is_stale(exp.model_version, current_version, max_staleness):
            kept.append(exp)
            needs_correction.append(False)
            continue
        stale += 1
        if policy is StalenessPolicy.DROP:
            dropped += 1
        else:
            kept.append(exp)
            needs_correction.append(True)
    return StalenessDecision(kept, needs_correction, dropped, stale, max_lag)
