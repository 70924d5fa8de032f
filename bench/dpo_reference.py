"""What DPO's reference logprobs cost where streamrft computes them (the producer, once per pair) against where it
does not (a reference model kept by the trainer, a forward per DPO row per step), on the demo model.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/dpo_reference.py [--pairs 32]

Pairs are demo-style sums: "What is a + b?", chosen "a + b = c. The answer is c.", rejected the same with c + 1.
Measured, each the median of --repeats: reading and tokenising the pairs (the SFT path's cost), the same with the
reference scoring (``streamrft data produce --as dpo`` without Kafka), one DPO training step on all the pairs, and
the no-grad forward a trainer-side reference model would add to that step; and the memory a second copy of the
model takes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from streamrft.model_paths import resolve_model_path
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.producers.chat_rows import ChatMapping
from streamrft.engines.training.reference import ReferencePolicy
from streamrft.producers.supervised_data import dpo_pair, read_dpo
from streamrft.producers.task_files import read_rows

console = Console()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = resolve_model_path(args.model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    source = write_pairs(Path(tempfile.mkdtemp()) / "pairs.jsonl", args.pairs)
    mapping = ChatMapping(dataset="bench")
    reference = ReferencePolicy(model_dir, batch_size=16)

    def tokenise_only():
        return [dpo_pair(line, row, mapping, tokenizer) for line, row in read_rows(source)]

    def produce_with_reference():
        return list(read_dpo(source, mapping, tokenizer, reference))

    pairs = produce_with_reference()
    rows = [side for pair in pairs for side in pair]
    tokens = sum(len(side.tokens) // 4 for side in rows)
    engine = TrainingEngine(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                            TrainingSettings(lr=1e-6, micro_batch_size=16), device="cpu")
    batch = engine.collate(rows)

    def train_step():
        return engine.train_step(rows)

    def reference_forward():  # what a trainer-side reference model would add to each step
        return engine.compute_logprobs(batch, reference.model)

    timings = {name: timed(fn, args.repeats) for name, fn in (
        ("tokenise only (the SFT path)", tokenise_only), ("tokenise + reference scoring", produce_with_reference),
        ("DPO training step", train_step), ("+ a trainer-side reference forward", reference_forward))}
    model_bytes = sum(p.numel() * p.element_size() for p in reference.model.parameters())
    table = Table(title=f"{args.pairs} pairs ({len(rows)} rows, {tokens} tokens), {model_dir.name}, fp32, "
                        f"{torch.get_num_threads()} threads; medians of {args.repeats}")
    table.add_column("what")
    table.add_column("seconds")
    table.add_column("per pair")
    for name, seconds in timings.items():
        table.add_row(name, f"{seconds:.2f}", f"{1000 * seconds / args.pairs:.0f} ms")
    console.print(table)
    scoring = timings["tokenise + reference scoring"] - timings["tokenise only (the SFT path)"]
    console.print(f"reference scoring at produce time: {scoring:.2f} s for {args.pairs} pairs, once per pair; a "
                  f"trainer-side reference: {timings['+ a trainer-side reference forward']:.2f} s more per step "
                  f"({100 * timings['+ a trainer-side reference forward'] / timings['DPO training step']:.0f} % of "
                  f"the step) and {model_bytes / 2**20:.0f} MiB for a second copy of the model")
    return 0


def write_pairs(path: Path, n: int) -> Path:
    rows = []
    for k in range(n):
        a, b = 1 + k % 20, 1 + (7 * k) % 20
        rows.append({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}. The answer is {a + b}.",
                     "rejected": f"{a} + {b} = {a + b + 1}. The answer is {a + b + 1}."})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    raise SystemExit(main())
