"""Where bf16 is the faster arithmetic, settled once per process: the dtype the trainer's forward and backward
autocast to (``trainer.mixed_precision``) and the one a rollout engine on a CPU runs in (``model.dtype``).

``auto`` means bf16 where it pays: always on CUDA; on a CPU only where a measured probe finds bf16 matrix
products at least :data:`BF16_PAYS` times as fast as float32 (CPUs with bf16 matrix units: AVX512-BF16, AMX).
Elsewhere bf16 is emulated and slower, so float32 stays. The trainer's master weights and optimiser stay float32
either way, and the softmax of its loss runs in float32 (``training/logprobs.py``).

``STREAMRFT_CPU_BF16_SPEEDUP`` stands in for the probe's measurement where a run must not depend on the CPU it
lands on (the test suite sets it to 1: float32 everywhere, as its float32 references expect)."""
from __future__ import annotations

import functools
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

BF16_PAYS = 1.3  # bf16's speed-up below which the rounding is not worth it
PROBE_SHAPE = (256, 512, 1536)  # rows × hidden × an MLP's width: a small model's matmul, ~0.4 GFLOP a product
PROBE_REPEATS = 5
PROBE_WARMUP = 3
SPEEDUP_ENV = "STREAMRFT_CPU_BF16_SPEEDUP"


def autocast_dtype(mode: str, device: torch.device, parallel) -> torch.dtype | None:
    """None (float32) or torch.bfloat16 for ``mode`` ("auto", "bf16", "no") on ``device``; every rank of
    ``parallel`` (a :mod:`.parallel` strategy) gets the same answer."""
    if mode == "no":
        return None
    if mode == "bf16" or device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu":
        return None
    speedup = cpu_bf16_speedup()
    use_bf16 = parallel.max(1.0 if speedup >= BF16_PAYS else 0.0) > 0  # one rank's yes is every rank's
    logger.info("trainer.mixed_precision auto: bf16 matmuls run %.2f× float32's speed on this CPU; training in %s "
                "(set trainer.mixed_precision to bf16 or no to choose)", speedup, "bf16" if use_bf16 else "float32")
    return torch.bfloat16 if use_bf16 else None


def inference_dtype(configured: str, device: str) -> str:
    """The dtype a rollout engine on ``device`` ("cpu", "cuda", "auto", ...) loads for ``model.dtype``
    ``configured``: on a CPU, "auto" becomes bfloat16 where the probe says it pays, else float32 (a checkpoint's
    own dtype says nothing about the CPU it runs on); anything else is kept."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if configured != "auto" or not on_cpu:
        return configured
    speedup = cpu_bf16_speedup()
    chosen = "bfloat16" if speedup >= BF16_PAYS else "float32"
    logger.info("model.dtype auto: bf16 matmuls run %.2f× float32's speed on this CPU; the rollout engine runs in "
                "%s (set model.dtype to choose)", speedup, chosen)
    return chosen


@functools.cache
def cpu_bf16_speedup() -> float:
    """float32 time / bf16 time of the same matrix product on this CPU (best of :data:`PROBE_REPEATS` each, so a
    busy neighbour inflates neither), measured once per process."""
    pinned = os.environ.get(SPEEDUP_ENV)
    if pinned:
        try:
            return float(pinned)
        except ValueError:
            raise ValueError(f"{SPEEDUP_ENV}={pinned!r} is not a number: set it to bf16's speed-up over float32 "
                             f"(e.g. 1 for float32, 2 for bf16) or unset it to measure") from None
    return _best_time(torch.float32) / _best_time(torch.bfloat16)


def _best_time(dtype: torch.dtype) -> float:
    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    for _ in range(PROBE_WARMUP):  # the first calls pick, generate and cache the kernel
        a @ b
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return best
