"""The distributed trainer on this machine: optimiser steps/s of one process against 2 gloo ranks (FSDP2 and
DDP) on the same batches, same model, same cores.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/distributed_trainer.py [--steps 6] [--batch 32]

On a CPU the ranks share the cores one process would use, so the ratio is the cost of the path (collectives,
the command channel, padding micro-batches), not a speed-up: speed-ups are for GPUs, one rank each. Each side
runs ``--steps`` timed steps after one warm-up step; the model is a randomly initialised Llama of the demo's
architecture (hidden 256, 4 layers, vocabulary 2048), built the same way in every process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = TrainingSettings(lr=1e-5, micro_batch_size=8)


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0))


def batch(step: int, size: int) -> list[Experience]:
    generator = torch.Generator().manual_seed(step)
    out = []
    for i in range(size):
        response = 16 + int(torch.randint(0, 48, (1,), generator=generator))
        tokens = torch.randint(1, 2048, (32 + response,), generator=generator).tolist()
        out.append(Experience(eid=f"{step}-{i}", group_id=f"{step}-{i // 8}", task_id="t", step=step,
                              kind=RolloutKind.TRAIN, run_index=i % 8, model_version=step,
                              tokens=pack_i32(tokens), prompt_length=32, logprobs=pack_f32([-7.0] * response),
                              reward=float(i % 3 == 0)))
    return out


def timed_steps(train_step, steps: int, size: int) -> float:
    train_step(batch(0, size))  # warm-up
    started = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(batch(step, size))
    return time.perf_counter() - started


def rank_main(out: Path, strategy_name: str, steps: int, size: int) -> None:
    """One rank of the 2-rank side (run by torchrun)."""
    import torch.distributed as dist

    from streamrft.engines.training.parallel import strategy
    from streamrft.engines.training.ranks import CommandChannel, RankZeroEngine, follow, init_ranks

    info = init_ranks("cpu")
    engine = TrainingEngine(build_model(), SETTINGS, device="cpu", parallel=strategy(strategy_name))
    channel = CommandChannel()
    if info.rank == 0:
        ranked = RankZeroEngine(engine, channel)
        seconds = timed_steps(ranked.train_step, steps, size)
        ranked.stop_followers()
        out.write_text(json.dumps({"seconds": seconds}))
    else:
        follow(engine, channel)
    dist.destroy_process_group()


def two_ranks(strategy_name: str, steps: int, size: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(Path(__file__).resolve()), "--rank-of", strategy_name, "--out", str(out),
                        "--steps", str(steps), "--batch", str(size)], check=True, env=env, cwd=ROOT)
        return json.loads(out.read_text())["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="experiences per step")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        return rank_main(Path(args.out), args.rank_of, args.steps, args.batch)

    from rich.console import Console
    from rich.table import Table

    console = Console()
    results = {}
    with console.status("one process"):
        engine = TrainingEngine(build_model(), SETTINGS, device="cpu")
        results["1 process"] = timed_steps(engine.train_step, args.steps, args.batch)
    for name in ("fsdp", "ddp"):
        with console.status(f"2 gloo ranks, {name}"):
            results[f"2 ranks, {name}"] = two_ranks(name, args.steps, args.batch)
    table = Table(title=f"trainer steps/s, {args.steps} steps × {args.batch} experiences, "
                        f"{os.cpu_count()} cores, CPU")
    for column in ("", "seconds", "steps/s", "vs 1 process"):
        table.add_column(column, justify="right")
    base = results["1 process"]
    for name, seconds in results.items():
        table.add_row(name, f"{seconds:.2f}", f"{args.steps / seconds:.3f}", f"{base / seconds:.2f}×")
    console.print(table)


if __name__ == "__main__":
    main()
