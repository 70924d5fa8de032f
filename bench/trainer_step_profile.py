"""Where the demo trainer's step goes: one optimiser step of the demo's geometry (SmolLM2-135M, 8 prompts x 8
completions, micro-batches of 16) timed by phase, with the machine's own matmul rate as the baseline.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/trainer_step_profile.py [--steps 2] [--bf16]
                                                                                  [--response 48] [--prompt 40]
                                                                                  [--recompute | --proximal]

Printed per phase (prepare: collate and any logprob recompute; backward: forward + backward of every
micro-batch; apply: clip + AdamW): seconds, and for the whole step the FLOPs it needs (6 x parameters x tokens
for forward + backward, 2 x for a forward alone) against what a plain float32 (or bf16) matmul of this machine
reaches in the same run. A ratio near 1 means the step is compute-bound: only fewer tokens, fewer FLOPs per
token (bf16 matrix units) or more cores make it faster; a ratio well below 1 means time goes elsewhere, and the
profiler's top operators say where.

``--proximal`` instead times the recomputed old (proximal) logprobs both ways, alternating step by step on the
same engine: a separate no-grad forward in ``prepare`` (``recompute_old_logprobs`` before), and taken from the
training forward of a batch that trains one update (``train_step`` now; ``engines/training/proximal.py``).
"""
from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from streamrft.model_paths import resolve_model_path
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32

console = Console()


def demo_batch(step: int, prompts: int, repeat: int, prompt_len: int, response_len: int,
               vocab: int) -> list[Experience]:
    """Random tokens of the demo's shape: each group shares a prompt; responses up to ``response_len``."""
    generator = torch.Generator().manual_seed(step)
    out = []
    for p in range(prompts):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=generator).tolist()
        for r in range(repeat):
            length = int(torch.randint(response_len // 2, response_len + 1, (1,), generator=generator))
            response = torch.randint(1, vocab, (length,), generator=generator).tolist()
            out.append(Experience(eid=f"{step}-{p}-{r}", group_id=f"{step}-{p}", task_id=f"t{p}", step=step,
                                  kind=RolloutKind.TRAIN, run_index=r, model_version=step,
                                  tokens=pack_i32(prompt + response), prompt_length=prompt_len,
                                  logprobs=pack_f32([-2.0] * length), reward=float(r % 2)))
    return out


def matmul_gflops(dtype: torch.dtype, size: int = 1536, repeats: int = 8) -> float:
    """The machine's plain matmul rate: the ceiling a compute-bound step can approach."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - started) / 1e9


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=40, help="prompt tokens (the demo's chat prompts: ~40)")
    parser.add_argument("--response", type=int, default=48, help="at most this many response tokens")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (trainer.mixed_precision: bf16)")
    parser.add_argument("--recompute", action="store_true", help="recompute the old logprobs (one more forward)")
    parser.add_argument("--proximal", action="store_true",
                        help="time recomputed proximal logprobs by a separate forward against in the training pass")
    args = parser.parse_args()

    settings = TrainingSettings(lr=1e-5, micro_batch_size=args.micro_batch,
                                mixed_precision="bf16" if args.bf16 else "no",
                                recompute_old_logprobs=args.recompute or args.proximal)
    with console.status("loading the model"):
        engine = TrainingEngine.from_pretrained(resolve_model_path(args.model), settings, device="cpu")
    params = sum(p.numel() for p in engine.model.parameters())
    vocab = engine.model.config.vocab_size
    if args.proximal:
        return compare_proximal(engine, args, vocab)
    rows = []
    for step in range(args.steps + 1):
        experiences = demo_batch(step, args.prompts, args.repeat, args.prompt, args.response, vocab)
        batch, prepare_s = timed(lambda: engine.prepare(experiences))
        _, backward_s = timed(lambda: engine.backward(batch))
        _, apply_s = timed(engine.apply_gradients)
        tokens = sum(len(e.tokens) // 4 for e in experiences)
        if step:  # step 0 warms up
            rows.append((prepare_s, backward_s, apply_s, tokens))
        console.print(f"step {step}{' (warm-up)' if not step else ''}: prepare {prepare_s:.2f}s, "
                      f"backward {backward_s:.2f}s, apply {apply_s:.2f}s, {tokens} tokens")

    prepare_s, backward_s, apply_s, tokens = (sum(r[i] for r in rows) / len(rows) for i in range(4))
    step_s = prepare_s + backward_s + apply_s
    flops = (6 + (2 if args.recompute else 0)) * params * tokens
    achieved = flops / step_s / 1e9
    with console.status("timing a plain matmul"):
        ceiling = matmul_gflops(torch.bfloat16 if args.bf16 else torch.float32)
    table = Table(title=f"trainer step: {args.model} ({params / 1e6:.0f}M parameters), "
                        f"{args.prompts * args.repeat} sequences, {tokens:.0f} tokens, micro-batch "
                        f"{args.micro_batch}, {'bf16 autocast' if args.bf16 else 'fp32'}, "
                        f"{torch.get_num_threads()} threads")
    for column in ("phase", "seconds", "share"):
        table.add_column(column, justify="right")
    for name, seconds in (("prepare", prepare_s), ("backward (forward + backward)", backward_s),
                          ("apply (clip + AdamW)", apply_s), ("step", step_s)):
        table.add_row(name, f"{seconds:.2f}", f"{seconds / step_s:.0%}")
    console.print(table)
    console.print(f"step: {flops / 1e12:.2f} TFLOP at {achieved:.0f} GFLOP/s; plain "
                  f"{'bf16' if args.bf16 else 'fp32'} matmul here: {ceiling:.0f} GFLOP/s -> "
                  f"{achieved / ceiling:.2f} of the machine's matmul rate")

    experiences = demo_batch(99, args.prompts, args.repeat, args.prompt, args.response, vocab)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        engine.optimizer_step(engine.prepare(experiences))
    console.print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


def compare_proximal(engine: TrainingEngine, args: argparse.Namespace, vocab: int) -> int:
    """One warm-up step, then ``args.steps`` pairs of steps on the same batches: separate forward, in the pass."""
    ways = {"separate no-grad forward": False, "in the training pass": True}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for step in range(args.steps + 1):
        experiences = demo_batch(step, args.prompts, args.repeat, args.prompt, args.response, vocab)
        for way, one_update in ways.items():
            _, step_s = timed(lambda: engine.optimizer_step(engine.prepare(experiences, one_update=one_update)))
            if step:
                seconds[way].append(step_s)
            console.print(f"step {step}{' (warm-up)' if not step else ''}, {way}: {step_s:.2f}s")
    table = Table(title=f"recomputed proximal logprobs: {args.model}, {args.prompts * args.repeat} sequences, "
                        f"micro-batch {args.micro_batch}, {'bf16 autocast' if args.bf16 else 'fp32'}, "
                        f"{torch.get_num_threads()} threads, {args.steps} step(s) each")
    for column in ("proximal logprobs", "step s (mean)", "steps", "vs separate"):
        table.add_column(column, justify="right")
    baseline = sum(seconds["separate no-grad forward"]) / args.steps
    for way, values in seconds.items():
        mean = sum(values) / len(values)
        table.add_row(way, f"{mean:.2f}", " ".join(f"{v:.1f}" for v in values), f"{mean / baseline:.2f}x")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
