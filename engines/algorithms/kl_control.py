"""The KL coefficient's controller: fixed, or adaptive toward a target KL (Ziegler et al. 2019, "Fine-Tuning
Language Models from Human Preferences", §2.2; veRL's ``AdaptiveKLController``). Plain arithmetic, no torch: its
state is two numbers, saved with the training engine's so a resumed run goes on with the coefficient it had."""
from __future__ import annotations

from dataclasses import dataclass

# Ziegler et al.'s clip of the proportional error: one step moves the coefficient by at most 20 % of n/horizon
MAX_ERROR = 0.2


@dataclass
class KlController:
    """``coef`` weighs the KL reward penalty. Adaptive (``target`` set): after each batch,

    ``e = clip(KL / target − 1, −0.2, 0.2)``, ``coef ← coef · (1 + e · n / horizon)``

    where ``KL`` is the batch's mean per-token KL to the reference and ``n`` its number of samples: the
    coefficient grows while the policy drifts further than the target and shrinks while it stays closer, with a
    time constant of ``horizon`` samples. Fixed (``target`` None): ``coef`` never moves."""

    coef: float
    target: float | None = None
    horizon: int = 10_000
    updates: int = 0

    def __post_init__(self) -> None:
        if self.target is not None and (self.target <= 0 or self.horizon < 1):
            raise ValueError(f"an adaptive KL controller needs target > 0 and horizon >= 1, got {self.target}, "
                             f"{self.horizon}")

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.target is None:
            return
        error = min(max(current_kl / self.target - 1.0, -MAX_ERROR), MAX_ERROR)
        self.coef *= 1.0 + error * n_steps / self.horizon
        self.updates += 1

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "updates": self.updates}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint written without a controller) keeps the configured
        coefficient."""
        if state is not None:
            self.coef = float(state["coef"])
            self.updates = int(state["updates"])
