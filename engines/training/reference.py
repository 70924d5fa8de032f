"""The reference policy of DPO: the model the training starts from, frozen, scoring each response once, when
its pair is produced.

Why here and not in the trainer: a DPO record then carries its reference logprobs in ``logprobs`` (the field
that holds, for a rollout, the logprobs of the policy it is compared with), so
- the trainer keeps no second copy of the model (538 MB for the demo model in fp32; 28 GB for a 7B one) and
  runs no reference forward in its steps;
- the reference forward runs once per pair, on the producer's machine, off the trainer's critical path;
- a record means the same whoever trains it and whenever: a replay, a fan-out trainer or a resumed one need
  not keep the initial weights.
The price: the file is produced with the model (``model.path``), and it must be the model the trainer starts
from (``info.reference`` names it). Scoring is in fp32 at temperature 1, as the trainer scores supervised rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..models import MODEL_LOAD_LOCK
from .batch import collate
from .logprobs import response_logprobs
from streamrft.schemas import Experience


class ReferencePolicy:
    """A frozen causal LM that gives the logprob of every response token of experiences, a batch at a time."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", batch_size: int = 8):
        from transformers import AutoModelForCausalLM

        with MODEL_LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.name = Path(model_dir).name
        self.pad_token_id = int(getattr(model.config, "pad_token_id", None) or 0)

    @torch.no_grad()
    def logprobs(self, experiences: Sequence[Experience]) -> list[list[float]]:
        """Per experience, the reference logprob of each of its response tokens."""
        out: list[list[float]] = []
        for start in range(0, len(experiences), self.batch_size):
            chunk = experiences[start:start + self.batch_size]
            batch = collate(chunk, pad_token_id=self.pad_token_id).to(self.device)
            logp, _ = response_logprobs(self.model, batch, temperature=1.0)
            out += [logp[row, : exp.response_length].tolist() for row, exp in enumerate(chunk)]
        return out
