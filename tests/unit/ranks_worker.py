"""Run under torchrun by test_distributed_training.py: two training steps on the test batch through rank 0's
command channel, then the gathered weights, the metrics and the engine state (sharded under FSDP) into OUT."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from streamrft.engines.training import TrainingEngine
from streamrft.engines.training.parallel import strategy
from streamrft.engines.training.ranks import CommandChannel, RankZeroEngine, follow, init_ranks

from .test_distributed_training import STEPS, VARIANTS, batches, tiny_model


def main(out: Path, strategy_name: str, variant: str) -> None:
    info = init_ranks("cpu")
    engine = TrainingEngine(tiny_model(), VARIANTS[variant], device="cpu", parallel=strategy(strategy_name))
    channel = CommandChannel()
    held = [p.to_local() if hasattr(p, "to_local") else p for p in engine.model.parameters()]
    (out / f"rank{info.rank}.json").write_text(json.dumps({
        "local": sum(p.numel() for p in held),
        "total": sum(p.numel() for p in engine.model.parameters())}))
    if info.rank != 0:
        follow(engine, channel)
    else:
        ranked = RankZeroEngine(engine, channel)
        metrics = [ranked.train_step(batch) for batch in batches()[:STEPS]]
        torch.save(dict(ranked.named_weights()), out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
        (out / "state").mkdir()
        ranked.save_state(out / "state")
        ranked.stop_followers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
