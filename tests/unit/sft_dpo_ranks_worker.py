"""Run under torchrun by test_sft_dpo_ranks.py: the mixed steps of that test on FSDP ranks, through rank 0's command
channel; the metrics and the gathered weights into OUT."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from streamrft.engines.training import TrainingEngine
from streamrft.engines.training.parallel import strategy
from streamrft.engines.training.ranks import CommandChannel, RankZeroEngine, follow, init_ranks

from .test_sft_dpo_ranks import SETTINGS, STEPS
from .test_sft_dpo import tiny_llama


def main(out: Path) -> None:
    info = init_ranks("cpu")
    engine = TrainingEngine(tiny_llama().train(), SETTINGS, device="cpu", parallel=strategy("fsdp"))
    channel = CommandChannel()
    if info.rank != 0:
        follow(engine, channel)
    else:
        ranked = RankZeroEngine(engine, channel)
        metrics = [ranked.train_step(batch) for batch in STEPS]
        torch.save(dict(ranked.named_weights()), out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
        ranked.stop_followers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
