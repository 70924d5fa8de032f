"""The trainer: turns experiences into weight updates. The role is :class:`Trainer` (``role.py``: its numbered
loop); each of its jobs is a small class of its own: the group buffer (``group_buffer.py``), the batch and
end-of-stream rules (``batches.py``), the supervised rows of ``trainer.mix`` (``mix.py``, read by
``supervised_stream.py``), publishing the weights (``publishing.py``), checkpoints and where reading starts
(``lineage.py``, ``checkpoints.py``, ``replay.py``) and its Prometheus series (``metrics.py``). What it reads is
:class:`streamrft.run_shape.RunShape`'s, when it publishes :class:`streamrft.pacing.Pacing`'s."""
from .engine import build_engine
from .replay import ReplayStart, parse_replay_from
from .role import Trainer

__all__ = ["ReplayStart", "Trainer", "build_engine", "parse_replay_from"]
