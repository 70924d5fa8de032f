"""The GPU check: one command, under 10 minutes, for a machine with a CUDA GPU and no internet.

    python bench/gpu_check.py [--out DIR] [--steps 5]
    python bench/gpu_check.py --smoke        # the same code on the CPU with the tiny model, to check the script

It builds a randomly initialised ~0.4B Llama-architecture model locally (SmolLM2's architecture, scaled up:
hidden 1024, 24 layers, GQA 16/4 heads) with the tiny tokenizer, and reports, each beside its baseline:

1. generation — streamrft's transformers engine on the GPU (bf16); with ``vllm`` importable, streamrft's vLLM
   engine and raw ``vllm.LLM.generate`` on the same prompt ids (the goal: vLLM engine ≥ 0.9 × raw);
2. weight sync — the trainer's weights into the engine: ``load_weights`` of the whole model (GPU → GPU) against a
   plain ``copy_`` of the same tensors; with two or more GPUs, ``broadcast_weights`` over NCCL from GPU 0 to GPU
   1 (NCCL cannot put two ranks on one GPU, so with one GPU this part says so and is skipped);
3. training — ``--steps`` GRPO steps of the training engine on the GPU (bf16 autocast) on rollouts of the
   engine, seconds per step and tokens/s.

Figures go to stdout (a rich table) and ``--out``/gpu_check.json. Nothing here needs Kafka: the broker's Java
runtime is not on such machines; the roles' Kafka paths are the ones the CPU suite tests.
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

MODEL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
         "num_key_value_heads": 4, "max_position_embeddings": 2048, "initializer_range": 0.02}


DEVICE = "cuda"
DTYPE = "bfloat16"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_time(call, repeats: int = 3) -> float:
    call()
    synchronize()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def generation(model_dir: Path, figures: dict, console: Console) -> None:
    from streamrft.engines.inference import SamplingParams, create_engine

    prompts = [[3 + (i * 7 + j) % 90 for j in range(24)] for i in range(64)]
    params = SamplingParams(temperature=1.0, max_tokens=128)
    engine = create_engine("transformers", model_dir, device=DEVICE, dtype=DTYPE, max_batch_size=256)
    seconds = median_time(lambda: engine.generate(prompts, params, n=4))
    out = engine.generate(prompts, params, n=4)
    figures["transformers_tokens_per_s"] = sum(len(c.response_ids) for r in out for c in r) / seconds
    engine.close()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        figures["vllm"] = f"not run: vllm is not importable here ({exc})"
        console.print(f"[yellow]{figures['vllm']}[/]")
        return
    from vllm.inputs import TokensPrompt

    engine = create_engine("vllm", model_dir, dtype=DTYPE, gpu_memory_utilization=0.5, max_model_len=512,
                           **({} if DEVICE == "cuda" else {"kv_cache_gib": 1, "enforce_eager": True}))
    seconds = median_time(lambda: engine.generate(prompts, params, n=4))
    out = engine.generate(prompts, params, n=4)
    figures["vllm_tokens_per_s"] = sum(len(c.response_ids) for r in out for c in r) / seconds
    raw = engine._vllm.SamplingParams(n=4, temperature=1.0, max_tokens=128)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    seconds = median_time(lambda: engine.llm.generate(requests, raw, use_tqdm=False))
    outputs = engine.llm.generate(requests, raw, use_tqdm=False)
    figures["raw_vllm_tokens_per_s"] = sum(len(s.token_ids) for r in outputs for s in r.outputs) / seconds
    figures["vllm_vs_raw"] = figures["vllm_tokens_per_s"] / figures["raw_vllm_tokens_per_s"]
    engine.close()


def weight_sync(model_dir: Path, figures: dict, console: Console) -> None:
    from transformers import AutoModelForCausalLM

    from streamrft.engines.inference import create_engine

    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).to(DEVICE)
    weights = dict(source.state_dict())
    figures["model_params"] = sum(t.numel() for t in source.parameters())
    figures["weights_gb"] = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    engine = create_engine("transformers", model_dir, device=DEVICE, dtype=DTYPE)
    targets = {name: torch.empty_like(t) for name, t in weights.items()}
    figures["raw_copy_s"] = median_time(lambda: [targets[n].copy_(t) for n, t in weights.items()])
    figures["engine_load_s"] = median_time(lambda: engine.load_weights(weights, 1))
    figures["engine_load_vs_copy"] = figures["engine_load_s"] / figures["raw_copy_s"]
    engine.close()
    if DEVICE != "cuda" or torch.cuda.device_count() < 2:
        gpus = torch.cuda.device_count() if DEVICE == "cuda" else 0
        figures["nccl"] = f"not run: NCCL needs a second GPU for the receiving rank ({gpus} here)"
        console.print(f"[yellow]{figures['nccl']}[/]")


def training(model_dir: Path, steps: int, figures: dict) -> None:
    from streamrft.engines.inference import SamplingParams, create_engine
    from streamrft.engines.training import TrainingEngine, TrainingSettings
    from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32

    engine = create_engine("transformers", model_dir, device=DEVICE, dtype=DTYPE)
    precision = "bf16" if DEVICE == "cuda" else "no"
    trainer = TrainingEngine.from_pretrained(model_dir, TrainingSettings(lr=1e-6, micro_batch_size=16,
                                                                         mixed_precision=precision), device=DEVICE)
    prompts = [[3 + (i * 5 + j) % 90 for j in range(24)] for i in range(8)]
    seconds, tokens = [], 0
    for step in range(steps):
        rollouts = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=128), n=8)
        experiences = [
            Experience(eid=f"{step}-{i}-{j}", group_id=f"{step}-{i}", task_id=str(i), step=step,
                       kind=RolloutKind.TRAIN, run_index=j, model_version=step,
                       tokens=pack_i32(c.prompt_ids + c.response_ids), prompt_length=len(c.prompt_ids),
                       logprobs=pack_f32(c.logprobs), reward=float(j % 2), group_size=8)
            for i, row in enumerate(rollouts) for j, c in enumerate(row)]
        synchronize()
        started = time.perf_counter()
        trainer.train_step(experiences)
        synchronize()
        seconds.append(time.perf_counter() - started)
        tokens = sum(len(c.prompt_ids) + len(c.response_ids) for row in rollouts for c in row)
        engine.load_weights(trainer.named_weights(dtype=getattr(torch, DTYPE)), step + 1)
    figures["train_step_s_median"] = statistics.median(seconds[1:] or seconds)
    figures["train_tokens_per_s"] = tokens / figures["train_step_s_median"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32: checks the script itself")
    args = parser.parse_args()
    console = Console()
    global DEVICE, DTYPE
    if args.smoke:
        DEVICE, DTYPE, args.steps = "cpu", "float32", 2
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible; run it on a GPU machine (or --smoke)")
    from streamrft.engines.models import build_tiny_model

    figures: dict = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)",
                     "torch": torch.__version__}
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-")), seed=0,
                                 **({} if args.smoke else MODEL))
    for name, part in (("generation", lambda: generation(model_dir, figures, console)),
                       ("weight sync", lambda: weight_sync(model_dir, figures, console)),
                       ("training", lambda: training(model_dir, args.steps, figures))):
        with console.status(name):
            part()
    table = Table(title="gpu_check")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
