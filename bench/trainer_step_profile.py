"""Where the demo trainer's step goes: one optimiser step of the demo's geometry (SmolLM2-135M, 8 prompts x 8
completions, micro-batches of 16) timed by phase, with the machine's own matmul rate as the baseline.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/trainer_step_profile.py [--steps 2] [--bf16]
                                                                                  [--response 48] [--prompt 40]
                                                                                  [--recompute | --proximal |
                                                                                   --precision]
    ... bench/trainer_step_profile.py --packing [--long-tail 512] [--max-tokens 2048] [--micro-batch 16]

Printed per phase (prepare: collate and any logprob recompute; backward: forward + backward of every
micro-batch; apply: clip + AdamW): seconds, and for the whole step the FLOPs it needs (6 x parameters x tokens
for forward + backward, 2 x for a forward alone) against what a plain float32 (or bf16) matmul of this machine
reaches in the same run. A ratio near 1 means the step is compute-bound: only fewer tokens, fewer FLOPs per
token (bf16 matrix units) or more cores make it faster; a ratio well below 1 means time goes elsewhere, and the
profiler's top operators say where.

``--proximal`` instead times the recomputed old (proximal) logprobs both ways, alternating step by step on the
same engine: a separate no-grad forward in ``prepare`` (``recompute_old_logprobs`` before), and taken from the
training forward of a batch that trains one update (``train_step`` now; ``engines/training/proximal.py``).

``--precision`` times float32 against bf16 autocast the same way, alternating on one engine, and prints what
``trainer.mixed_precision: auto``'s probe (``engines/precision.py``) measures and picks on this machine.

``--packing`` times ``train_step`` and its peak memory three ways, alternating step by step on the same engine and
batches: padded rows in micro-batches of ``--micro-batch`` rows (the default trainer), micro-batches filled to
``--max-tokens`` tokens (``trainer.max_tokens_per_micro_batch``), and those packed without padding
(``trainer.pack_sequences``; ``engines/training/micro_batches.py``, ``packing.py``). ``--long-tail N`` makes the
batch's answers mostly short (``--response // 2`` to ``--response`` tokens) with ``--tail-share`` of them at N
tokens, as sampled reasoning answers are. Peak memory of a step: on CUDA ``torch.cuda.max_memory_allocated``
above what was allocated before it; on the CPU the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after returning freed heap with ``malloc_trim``) above its resident set before it.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import torch
from rich.console import Console
from rich.table import Table

from streamrft.model_paths import resolve_model_path
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines.training.micro_batches import MicroBatching
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


def long_tail_batch(step: int, prompts: int, repeat: int, prompt_len: int, response_len: int, vocab: int,
                    tail: int, tail_share: float) -> list[Experience]:
    """The demo batch with ``tail_share`` of its answers (at least one) at ``tail`` tokens, the rest as usual."""
    out = demo_batch(step, prompts, repeat, prompt_len, response_len, vocab)
    generator = torch.Generator().manual_seed(10_000 + step)
    long_ones = torch.randperm(len(out), generator=generator)[:max(1, round(tail_share * len(out)))].tolist()
    for i in long_ones:
        e = out[i]
        response = torch.randint(1, vocab, (tail,), generator=generator).tolist()
        out[i] = Experience(eid=e.eid, group_id=e.group_id, task_id=e.task_id, step=step, kind=e.kind,
                            run_index=e.run_index, model_version=step,
                            tokens=pack_i32(e.token_array[:e.prompt_length].tolist() + response),
                            prompt_length=e.prompt_length, logprobs=pack_f32([-2.0] * tail), reward=e.reward)
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
    parser.add_argument("--precision", action="store_true",
                        help="time float32 against bf16 autocast step by step, and say what mixed_precision auto "
                             "picks here")
    parser.add_argument("--packing", action="store_true",
                        help="time and peak memory of padded rows against a token budget and packed sequences")
    parser.add_argument("--max-tokens", type=int, default=2048, help="--packing: trainer.max_tokens_per_micro_batch")
    parser.add_argument("--long-tail", type=int, default=0, metavar="N",
                        help="--packing: --tail-share of the answers at N tokens (0: the demo batch)")
    parser.add_argument("--tail-share", type=float, default=0.06, help="share of the answers at --long-tail tokens")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    settings = TrainingSettings(lr=1e-5, micro_batch_size=args.micro_batch,
                                mixed_precision="bf16" if args.bf16 else "no",
                                recompute_old_logprobs=args.recompute or args.proximal)
    with console.status("loading the model"):
        engine = TrainingEngine.from_pretrained(resolve_model_path(args.model), settings, device=args.device)
    params = sum(p.numel() for p in engine.model.parameters())
    vocab = engine.model.config.vocab_size
    if args.proximal:
        return compare_proximal(engine, args, vocab)
    if args.packing:
        return compare_packing(engine, args, vocab)
    if args.precision:
        return compare_precision(engine, args, vocab)
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

    def step_with(one_update: bool, experiences: list[Experience]) -> str:
        engine.optimizer_step(engine.prepare(experiences, one_update=one_update))
        return ""

    seconds = alternate(ways, step_with, args, vocab)
    console.print(ab_table(f"recomputed proximal logprobs: {args.model}, {args.prompts * args.repeat} sequences, "
                           f"micro-batch {args.micro_batch}, {'bf16 autocast' if args.bf16 else 'fp32'}, "
                           f"{torch.get_num_threads()} threads, {args.steps} step(s) each",
                           "proximal logprobs", seconds))
    return 0


def compare_precision(engine: TrainingEngine, args: argparse.Namespace, vocab: int) -> int:
    """One warm-up step each, then ``args.steps`` rounds of one float32 and one bf16-autocast step on the same
    batch and engine (the autocast dtype switched between them, as ``trainer.mixed_precision`` would set it)."""
    from streamrft.engines.precision import BF16_PAYS, cpu_bf16_speedup

    def step_in(dtype: torch.dtype | None, experiences: list[Experience]) -> str:
        engine.autocast_dtype = dtype
        return f", loss {engine.train_step(experiences)['actor/loss']:.4f}"

    seconds = alternate({"float32": None, "bf16 autocast": torch.bfloat16}, step_in, args, vocab)
    console.print(ab_table(f"trainer step by precision: {args.model}, {args.prompts * args.repeat} sequences, "
                           f"micro-batch {args.micro_batch}, {engine.device}, {torch.get_num_threads()} threads, "
                           f"{args.steps} step(s) each", "precision", seconds))
    if engine.device.type == "cpu":
        speedup = cpu_bf16_speedup()
        console.print(f"mixed_precision auto's probe: bf16 matmuls at {speedup:.2f}x float32's speed -> "
                      f"{'bf16' if speedup >= BF16_PAYS else 'float32'} here (threshold {BF16_PAYS}x)")
    return 0


def alternate(ways: dict, step, args: argparse.Namespace, vocab: int) -> dict[str, list[float]]:
    """One warm-up step per way, then ``args.steps`` rounds of one step per way on the same demo batch:
    ``step(value, experiences)`` runs one (returning what to add to its line); the timed seconds by way."""
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(args.steps + 1):
        experiences = demo_batch(round_, args.prompts, args.repeat, args.prompt, args.response, vocab)
        for way, value in ways.items():
            said, step_s = timed(lambda: step(value, experiences))
            if round_:
                seconds[way].append(step_s)
            console.print(f"step {round_}{' (warm-up)' if not round_ else ''}, {way}: {step_s:.2f}s{said}")
    return seconds


def ab_table(title: str, label: str, seconds: dict[str, list[float]]) -> Table:
    """Each way's mean step time, its steps, and its ratio to the first way's (the baseline)."""
    table = Table(title=title)
    baseline_name = next(iter(seconds))
    for column in (label, "step s (mean)", "steps", f"vs {baseline_name}"):
        table.add_column(column, justify="right")
    baseline = sum(seconds[baseline_name]) / len(seconds[baseline_name])
    for way, values in seconds.items():
        mean = sum(values) / len(values)
        table.add_row(way, f"{mean:.2f}", " ".join(f"{v:.1f}" for v in values), f"{mean / baseline:.2f}x")
    return table


class PeakMemory:
    """Peak memory of a block above what was in use when it began (module docstring: how, on CUDA and CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM to the current resident set
            self.start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak_bytes = _status_kib("VmHWM") * 1024 - self.start


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def compare_packing(engine: TrainingEngine, args: argparse.Namespace, vocab: int) -> int:
    """One warm-up step each, then ``args.steps`` rounds of one step per way, on the same batches."""
    base = engine.settings
    ways = {
        f"padded, {args.micro_batch} rows": base,
        f"padded, {args.max_tokens} tokens": base.model_copy(update={"max_tokens_per_micro_batch": args.max_tokens}),
        f"packed, {args.max_tokens} tokens": base.model_copy(update={"max_tokens_per_micro_batch": args.max_tokens,
                                                                    "pack_sequences": True}),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    peaks: dict[str, list[float]] = {way: [] for way in ways}
    for step in range(args.steps + 1):
        if args.long_tail:
            experiences = long_tail_batch(step, args.prompts, args.repeat, args.prompt, args.response, vocab,
                                          args.long_tail, args.tail_share)
        else:
            experiences = demo_batch(step, args.prompts, args.repeat, args.prompt, args.response, vocab)
        for way, settings in ways.items():
            engine.settings = settings
            with PeakMemory(engine.device) as memory:
                metrics, step_s = timed(lambda: engine.train_step(experiences))
            if step:
                seconds[way].append(step_s)
                peaks[way].append(memory.peak_bytes / 2 ** 20)
            console.print(f"step {step}{' (warm-up)' if not step else ''}, {way}: {step_s:.2f}s, peak "
                          f"{memory.peak_bytes / 2 ** 20:.0f} MiB, loss {metrics['actor/loss']:.4f}")
    engine.settings = base
    console.width = max(console.width, 150)  # one line per way, also when piped
    lengths = [e.response_length for e in experiences]
    table = Table(title=f"trainer step by micro-batching: {args.model}, {len(experiences)} sequences (answers "
                        f"{min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}), "
                        f"{'bf16 autocast' if args.bf16 else 'fp32'}, {engine.device}, "
                        f"{torch.get_num_threads()} threads, {args.steps} step(s) each")
    for column in ("micro-batching", "micro-batches", "forward tokens", "step s (mean)", "vs padded rows",
                   "peak MiB (max)", "vs padded rows"):
        table.add_column(column, justify="right")
    batch = engine.collate(experiences)
    base_s, base_mib = (sum(seconds[next(iter(ways))]) / args.steps, max(peaks[next(iter(ways))]))
    for way in ways:
        mean_s, peak = sum(seconds[way]) / args.steps, max(peaks[way])
        micro = [m.batch for m in engine.parallel.micro_batches(batch, MicroBatching.of(ways[way]))]
        tokens = sum(m.packed.num_tokens if m.packed is not None else m.input_ids.numel() for m in micro)
        table.add_row(way, str(len(micro)), str(tokens), f"{mean_s:.2f}", f"{mean_s / base_s:.2f}x", f"{peak:.0f}",
                      f"{peak / base_mib:.2f}x")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
