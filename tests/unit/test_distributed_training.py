"""The training engine spread over two gloo ranks (torchrun, CPU) trains exactly like one process: same metrics,
same weights (fp32; only the order of floating-point sums differs), and a sharded checkpoint that one process
resumes from. FSDP2 and DDP, on batches whose rows do not split evenly (one rank runs padding micro-batches) and
with estimators that need the whole batch (REINFORCE++ whitens over it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines.training.parallel import ENGINE_FILE, SHARDED_DIR

from .test_training_engine import make_exp, tiny_llama

pytestmark = [pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3  # trained by the ranks; one more step checks the resumed optimiser state
VARIANTS = {
    # GRPO with a KL loss (a reference model, sharded too) and an entropy bonus, micro-batches of 2; a KL reward
    # penalty whose adaptive coefficient the ranks move alike and the sharded checkpoint keeps
    "grpo_kl": TrainingSettings(lr=1e-3, micro_batch_size=2, kl_coef=0.1, entropy_coef=0.01, kl_penalty_coef=0.05,
                                kl_ctrl="adaptive", target_kl=1e-4, kl_horizon=8),
    # REINFORCE++ (whitened over the whole batch), per-sequence loss, truncated IS on every row
    "reinforce": TrainingSettings(lr=1e-3, micro_batch_size=3, advantage="reinforce_plus_plus",
                                  loss_agg="seq-mean-token-mean", tis=True),
    # micro-batches by a token budget, packed: the ranks' counts differ, so one runs packed padding micro-batches
    "packed": TrainingSettings(lr=1e-3, max_tokens_per_micro_batch=14, pack_sequences=True, entropy_coef=0.01),
}
COMPARED = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ratio_mean",
            "actor/ratio_max", "actor/advantage_abs_mean", "actor/num_tokens", "actor/reward_mean")


def tiny_model(seed: int = 0):
    return tiny_llama(seed).train()


def batches() -> list[list]:
    """Four steps of 7, 5, 1 and 6 experiences (uneven over 2 ranks; one rank gets no row at all)."""
    def exp(i: int, group: str, length: int, reward: float):
        tokens = [1 + (i * 7 + k * 3) % 15 for k in range(3 + length)]
        return make_exp(tokens, 3, reward=reward, group=group, eid=f"{group}-{i}",
                        logprobs=[-2.0 - 0.1 * k for k in range(length)])

    sizes = (7, 5, 1, 6)
    out = []
    for step, size in enumerate(sizes):
        out.append([exp(i, f"s{step}g{i % 2}", 1 + (i * 5 + step) % 6, float((i + step) % 3 == 0))
                    for i in range(size)])
    return out


def run_ranks(out: Path, strategy: str, variant: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "tests.unit.ranks_worker", str(out), strategy, variant]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


@pytest.mark.parametrize("strategy, variant", [("fsdp", "grpo_kl"), ("ddp", "reinforce"), ("fsdp", "reinforce"),
                                               ("fsdp", "packed")])
def test_two_gloo_ranks_train_like_one_process(tmp_path, strategy, variant):
    run_ranks(tmp_path, strategy, variant)
    total = sum(p.numel() for p in tiny_model().parameters())
    for rank in (0, 1):  # FSDP: half the parameters each (dim-0 shards, rounded up per tensor); DDP: all
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held["total"] == total
        assert 0.4 * total < held["local"] < 0.6 * total if strategy == "fsdp" else held["local"] == total
    single = TrainingEngine(tiny_model(), VARIANTS[variant], device="cpu")
    expected = [single.train_step(batch) for batch in batches()[:STEPS]]
    got = json.loads((tmp_path / "metrics.json").read_text())
    for step, (one, two) in enumerate(zip(expected, got, strict=True)):
        assert set(one) == set(two)
        for key in COMPARED + (("actor/kl",) if "actor/kl" in one else ()):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (step, key)

    gathered = torch.load(tmp_path / "weights.pt")
    weights = dict(single.named_weights())
    assert list(gathered) == list(weights)  # the same names, tied lm_head once, in the same order
    for name, tensor in weights.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert max(float((tensor - tiny_model().state_dict()[name]).abs().max()) for name, tensor in weights.items()) > 1e-4

    # the ranks' checkpoint: sharded under FSDP, one file under DDP; one process resumes it, optimiser included
    state = tmp_path / "state"
    assert (state / SHARDED_DIR).is_dir() == (strategy == "fsdp") and (state / ENGINE_FILE).exists() == (
        strategy == "ddp")
    # other initial weights, so the load shows; the reference model is the run's base model, not checkpointed
    resumed = TrainingEngine(tiny_model(seed=1), VARIANTS[variant], device="cpu", ref_model=tiny_model())
    resumed.load_state(state)
    assert resumed.step == single.step == STEPS and resumed.lr == single.lr
    assert resumed.kl_ctrl.coef == pytest.approx(single.kl_ctrl.coef, rel=1e-6)
    for name, tensor in resumed.named_weights():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-4, atol=1e-5, msg=name)
    after_single = single.train_step(batches()[STEPS])
    after_resumed = resumed.train_step(batches()[STEPS])
    assert after_resumed["actor/loss"] == pytest.approx(after_single["actor/loss"], rel=1e-4, abs=1e-6)
    for (name, a), (_, b) in zip(resumed.named_weights(), single.named_weights()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)

