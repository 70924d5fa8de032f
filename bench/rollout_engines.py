"""Rollout engines side by side on the same prompts and sampling, in one run: tokens/s and samples/s.

    python bench/rollout_engines.py [--model DIR] [--prompts 64] [--n 4] [--max-tokens 32] [--repeats 3]
                                    [--vllm-dtype float32|bfloat16] [--kv-cache-gib 2]

* transformers — streamrft's transformers engine (fp32 on the CPU);
* vllm         — streamrft's vLLM engine (``VLLMEngine.generate``: seeded requests, logprobs, our Completions);
* raw vllm     — ``vllm.LLM.generate`` on the same prompt token ids with the same sampling, no logprobs asked,
                 on the same ``LLM`` instance: the floor streamrft's vLLM engine is measured against
                 (goal: vllm ≥ 0.9 × raw vllm).

Prompts are the demo's arithmetic questions through the model's chat template. Each figure is the median of
``--repeats`` timed calls after one warm-up call. Default model: the demo model if it has been prepared
(``scripts/setup.sh --demo``), else a tiny random model built in a temporary directory (which says little about
real throughput: its responses rarely end before ``--max-tokens``). Run benchmarks one at a time:
``flock /tmp/streamrft-bench.lock python bench/rollout_engines.py``.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

DEMO_MODEL = Path.home() / ".cache" / "streamrft" / "models" / "smollm2-135m-instruct"


def prompts_of(count: int) -> list[list[dict[str, str]]]:
    import json

    from streamrft.engines.tasks import make_arithmetic_tasks
    from streamrft.engines.workflows.arithmetic import ArithmeticWorkflow

    workflow = ArithmeticWorkflow()
    return [workflow.messages(json.loads(task.payload)) for task in make_arithmetic_tasks(count, seed=0)]


def timed(call, repeats: int) -> tuple[float, object]:
    call()  # warm-up: kernels, allocator, vLLM's first scheduling
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-dtype", default="float32", help="float32 matches the transformers engine")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    args = parser.parse_args()

    from streamrft.engines.inference import SamplingParams, create_engine
    from streamrft.engines.models import build_tiny_model

    console = Console()
    model = args.model or (DEMO_MODEL if DEMO_MODEL.is_dir() else None)
    if model is None:
        model = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")), seed=0)
        console.print(f"[yellow]demo model not prepared; a tiny random model in {model}[/]")
    prompts = prompts_of(args.prompts)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    rows: list[tuple[str, float, int, int]] = []

    with console.status("transformers engine"):
        engine = create_engine("transformers", model, device="cpu")
        seconds, out = timed(lambda: engine.generate(prompts, params, n=args.n), args.repeats)
        rows.append(("transformers", seconds, sum(len(c.response_ids) for r in out for c in r),
                     sum(len(r) for r in out)))
        ids = [engine.prompt_ids(p) for p in prompts]
        engine.close()

    with console.status("vllm engine"):
        engine = create_engine("vllm", model, dtype=args.vllm_dtype, kv_cache_gib=args.kv_cache_gib,
                               max_num_seqs=256, max_model_len=1024)
        seconds, out = timed(lambda: engine.generate(prompts, params, n=args.n), args.repeats)
        rows.append(("vllm (streamrft)", seconds, sum(len(c.response_ids) for r in out for c in r),
                     sum(len(r) for r in out)))

    with console.status("raw vllm.LLM.generate"):
        import vllm
        from vllm.inputs import TokensPrompt

        raw_params = vllm.SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
        requests = [TokensPrompt(prompt_token_ids=p) for p in ids]
        seconds, out = timed(lambda: engine.llm.generate(requests, raw_params, use_tqdm=False), args.repeats)
        rows.append(("raw vllm", seconds, sum(len(s.token_ids) for r in out for s in r.outputs),
                     sum(len(r.outputs) for r in out)))
        engine.close()

    table = Table(title=f"{len(prompts)} prompts × n={args.n}, ≤{args.max_tokens} tokens, {model.name}, "
                        f"vLLM {args.vllm_dtype}")
    for column in ("engine", "s (median)", "tokens", "tokens/s", "samples/s", "× raw vllm"):
        table.add_column(column, justify="right")
    raw_rate = rows[-1][2] / rows[-1][1]
    for name, seconds, tokens, samples in rows:
        table.add_row(name, f"{seconds:.2f}", str(tokens), f"{tokens / seconds:.0f}", f"{samples / seconds:.1f}",
                      f"{tokens / seconds / raw_rate:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
