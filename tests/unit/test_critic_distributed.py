"""PPO with a critic on two gloo ranks (torchrun, CPU) trains like one process: the critic wrapped as the policy
is (FSDP2 shards it, DDP replicates it; with LoRA adapters where the policy has them), its values gathered over the
ranks, its loss and gradient the single process's, and its state resumed by one process. Run as a module, this
file is the ranks' program."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrft.engines.lora import LoraSettings
from streamrft.engines.training import TrainingEngine, TrainingSettings

from .test_distributed_training import batches, tiny_model

pytestmark = [pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3  # the first one the critic's warm-up (the policy waits), on 7, 5 and 1 rows (one rank gets none)
SETTINGS = TrainingSettings(lr=1e-3, micro_batch_size=2, advantage="gae", gae_lambda=0.95,
                            critic={"lr": 1e-3, "critic_warmup": 1, "cliprange_value": 0.05})
COMPARED = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values_mean",
            "critic/returns_mean", "critic/value_explained_var", "critic/grad_norm", "actor/advantage_abs_mean")
LORA = LoraSettings(rank=4, alpha=8.0)
WAYS = {"fsdp": ("fsdp", None), "ddp": ("ddp", None), "fsdp with lora": ("fsdp", LORA)}


@pytest.mark.parametrize("way", WAYS)
def test_the_critic_on_two_ranks_trains_like_one_process(tmp_path, way):
    strategy_name, lora = WAYS[way]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "tests.unit.test_critic_distributed", str(tmp_path), way]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    held = json.loads((tmp_path / "rank1.json").read_text())
    if strategy_name == "fsdp":
        assert 0.4 * held["total"] < held["local"] < 0.6 * held["total"]  # the critic is sharded too
    else:
        assert held["local"] == held["total"]  # replicated

    single = TrainingEngine(tiny_model(), SETTINGS, device="cpu", lora=lora)
    expected = [single.train_step(batch) for batch in batches()[:STEPS]]
    got = json.loads((tmp_path / "metrics.json").read_text())
    assert "critic/warmup" in got[0] and "actor/pg_loss" in got[1]
    for step, (one, two) in enumerate(zip(expected, got, strict=True)):
        assert set(one) == set(two)
        # the policy's loss of whitened advantages is ~0 on-policy: its gradient norm is what shows
        for key in COMPARED + (("actor/grad_norm",) if "actor/grad_norm" in one else ()):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (step, key)

    # under LoRA a checkpoint holds the adapters and the value head: the base weights are the pretrained ones
    resumed = TrainingEngine(tiny_model(seed=0 if lora else 1), SETTINGS, device="cpu", lora=lora)
    resumed.load_state(tmp_path / "state")  # the ranks' shards, into one process
    assert resumed.critic.step == single.critic.step == STEPS and resumed.step == single.step == STEPS - 1
    after_single, after_resumed = single.train_step(batches()[STEPS]), resumed.train_step(batches()[STEPS])
    for key in ("critic/values_mean", "critic/vf_loss", "critic/grad_norm", "actor/grad_norm"):
        assert after_resumed[key] == pytest.approx(after_single[key], rel=1e-4, abs=1e-6), key


def main(out: Path, way: str = "fsdp") -> None:
    """The ranks: STEPS training steps through rank 0's command channel, then the metrics and the sharded state."""
    import torch.distributed as dist

    from streamrft.engines.training.parallel import strategy
    from streamrft.engines.training.ranks import CommandChannel, RankZeroEngine, follow, init_ranks

    strategy_name, lora = WAYS[way]
    info = init_ranks("cpu")
    engine = TrainingEngine(tiny_model(), SETTINGS, device="cpu", parallel=strategy(strategy_name), lora=lora)
    channel = CommandChannel()
    critic = list(engine.critic.model.parameters())
    (out / f"rank{info.rank}.json").write_text(json.dumps({
        "local": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in critic),
        "total": sum(p.numel() for p in critic)}))
    if info.rank != 0:
        follow(engine, channel)
    else:
        ranked = RankZeroEngine(engine, channel)
        metrics = [ranked.train_step(batch) for batch in batches()[:STEPS]]
        (out / "metrics.json").write_text(json.dumps(metrics))
        (out / "state").mkdir()
        ranked.save_state(out / "state")
        ranked.stop_followers()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), *sys.argv[2:])
