"""Supervised rows over two FSDP ranks (torchrun, gloo on the CPU) train exactly like one process: the same
metrics and weights. Pairs are split over the ranks whole, and a rank with fewer pairs (or none) runs padding
micro-batches so that FSDP's collectives stay in step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrft.engines.training import TrainingEngine, TrainingSettings

from .test_sft_dpo import DPO, RL, SFT, pair, tiny_llama

pytestmark = [pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = TrainingSettings(lr=1e-3, micro_batch_size=2, recompute_old_logprobs=True)
THIRD_PAIR = pair("p3", [2, 4], [6, 8, 10, 12], [14], [-2.0] * 4, [-1.0])
STEPS = [SFT + RL + DPO + THIRD_PAIR,  # 3 pairs over 2 ranks: one rank has one pair, then a padding micro-batch
         DPO[:2],  # one pair: rank 1 trains nothing, only padding
         SFT[:1] + RL]  # one SFT row
COMPARED = ("sft/loss", "dpo/loss", "dpo/reward_margin", "dpo/accuracy", "actor/loss", "actor/grad_norm")


def test_two_fsdp_ranks_train_supervised_rows_like_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "tests.unit.sft_dpo_ranks_worker", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]

    single = TrainingEngine(tiny_llama().train(), SETTINGS, device="cpu")
    expected = [single.train_step(batch) for batch in STEPS]
    got = json.loads((tmp_path / "metrics.json").read_text())
    for step, (one, two) in enumerate(zip(expected, got, strict=True)):
        assert set(one) == set(two), step
        for key in COMPARED:
            if key in one:
                assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (step, key)
    gathered = torch.load(tmp_path / "weights.pt")
    for name, tensor in single.named_weights():
        torch.testing.assert_close(gathered[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
