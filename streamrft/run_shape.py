"""What a run is made of, in one place: which roles it has and what its trainer reads. The run config builds it
(``config.shape``, from ``mode`` and ``trainer.mix``); the launcher, the Kubernetes manifests, pacing, the explorer's
command and the trainer ask it, and none of them looks at the mode's name.

- ``both`` (the default): explorer, rollout workers, trainer and monitor. The trainer reads RL experiences; with
  ``trainer.mix`` each RL batch also takes its share of supervised rows (SFT, DPO) from a second reader.
- ``explore``: no trainer (data generation, evaluation of a fixed model): the explorer paces on nothing.
- ``train``: no explorer and no rollout workers: the trainer alone on the supervised rows of ``experiences``
  (``streamrft data produce``), to the data's end or ``trainer.total_steps``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Mode(StrEnum):
    BOTH = "both"
    EXPLORE = "explore"
    TRAIN = "train"


class TrainerInput(StrEnum):
    """What the trainer's batches are made of."""

    RL = "rl"  # RL experiences, one explorer step's groups a batch
    RL_WITH_SUPERVISED = "rl_with_supervised"  # trainer.mix: RL groups plus their share of supervised rows
    SUPERVISED = "supervised"  # supervised rows alone, in the order produced, to the data's end
    NONE = "none"  # no trainer


_ROLES = {Mode.BOTH: ("explorer", "rollout", "trainer", "monitor"),
          Mode.EXPLORE: ("explorer", "rollout", "monitor"),
          Mode.TRAIN: ("trainer", "monitor")}


@dataclass(frozen=True)
class RunShape:
    mode: Mode = Mode.BOTH
    mixes_supervised: bool = False  # trainer.mix is set

    def __post_init__(self) -> None:
        if self.mode == Mode.TRAIN and self.mixes_supervised:
            raise ValueError("trainer.mix shares supervised rows into RL batches; mode train has no RL rows (its "
                             "batches are all supervised, in the order produced): remove trainer.mix")

    # -- the roles ------------------------------------------------------------------------------------------
    @property
    def roles(self) -> tuple[str, ...]:
        """The roles the run starts (``streamrft run``, the Kubernetes manifests)."""
        return _ROLES[self.mode]

    @property
    def has_explorer(self) -> bool:
        """An explorer and its rollout workers roll out tasks."""
        return "explorer" in self.roles

    @property
    def has_trainer(self) -> bool:
        return "trainer" in self.roles

    @property
    def paces_on_trainer(self) -> bool:
        """The explorer waits for the trainer's weights and backlog (``streamrft/pacing.py``)."""
        return self.has_explorer and self.has_trainer

    @property
    def input_topic(self) -> str:
        """The topic the run's first role reads, which holds what the run is fed: tasks, or supervised rows."""
        return "tasks" if self.has_explorer else "experiences"

    # -- what the trainer reads -----------------------------------------------------------------------------
    @property
    def trainer_input(self) -> TrainerInput:
        if not self.has_trainer:
            return TrainerInput.NONE
        if not self.has_explorer:
            return TrainerInput.SUPERVISED
        return TrainerInput.RL_WITH_SUPERVISED if self.mixes_supervised else TrainerInput.RL

    @property
    def trainer_reads_supervised_only(self) -> bool:
        """The trainer's own reader takes supervised rows (and passes RL ones over), to the data's end."""
        return self.trainer_input == TrainerInput.SUPERVISED

    @property
    def trainer_mixes_supervised(self) -> bool:
        """A second reader of ``experiences`` gives each RL batch its share of supervised rows (``trainer.mix``)."""
        return self.trainer_input == TrainerInput.RL_WITH_SUPERVISED
