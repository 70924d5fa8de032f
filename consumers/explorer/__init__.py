"""The explorer: decides what to roll out and when. The role is :class:`Explorer` (``role.py``); each of its jobs
is a small class of its own: the task source and its epochs (``tasks.py``), the steps in flight (``rounds.py``),
eval rounds (``evals.py``) and retries (``retries.py``). Task order is :class:`streamrft.selection.Selector`'s,
pacing :class:`streamrft.pacing.Pacing`'s."""
from .evals import load_eval_tasks
from .role import Explorer

__all__ = ["Explorer", "load_eval_tasks"]
