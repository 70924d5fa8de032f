"""Weight sync cost: streamrft's transports against a raw safetensors save + load of the same tensors.

    python bench/weight_sync.py [--model DIR] [--repeats 3] [--shard-mb 1024] [--bucket-mb 256]

* raw          — ``safetensors.torch.save_file`` then ``load_file`` of all tensors, one file (the floor).
* object_store — ``ObjectStore.publish`` (sharded safetensors + sha256 + manifest, atomic moves, retention)
                 then ``load_weights`` (manifest and every shard verified).
* collective   — ``broadcast_weights`` from rank 0 to one receiver over gloo on this machine (two processes),
                 timed from the start of the broadcast until the receiver has every tensor.

Every method ends by copying the tensors into preallocated ones (what an engine's ``load_weights`` does), so
lazily memory-mapped tensors are really read. The goal is ≤ 2× raw for each transport. Default model: the demo model directory if it has been prepared,
else a tiny model built in a temporary directory.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from streamrft.engines.weights import (
    CollectiveGroup,
    ObjectStore,
    broadcast_weights,
    free_port,
    load_weights,
    receive_weights,
)

DEMO_MODEL = Path.home() / ".cache" / "streamrft" / "models" / "smollm2-135m-instruct"


def model_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        sys.exit(f"no *.safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for i in range(repeats):
        t0 = time.perf_counter()
        result = fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def into(dest: dict[str, torch.Tensor], loaded) -> dict[str, torch.Tensor]:
    """What an inference engine's ``load_weights`` does with what it is given: copy into its parameters.
    Every method ends with this, so lazily mapped tensors (``load_file`` mmaps) are really read."""
    for name, tensor in loaded:
        dest[name].copy_(tensor)
    return dest


def bench_raw(tensors, dest, workdir: Path, repeats: int):
    path = workdir / "raw.safetensors"

    def once(_):
        save_file(tensors, path)
        return into(dest, load_file(path).items())

    return timed(once, repeats)


def bench_object_store(tensors, dest, workdir: Path, repeats: int, shard_bytes: int):
    store = ObjectStore((workdir / "store").as_uri(), keep_last=2, max_shard_bytes=shard_bytes)
    split = []

    def once(version):
        t0 = time.perf_counter()
        pub = store.publish(tensors.items(), version)
        t1 = time.perf_counter()
        loaded = into(dest, load_weights(pub.uri, pub.sha256).items())
        split.append((t1 - t0, time.perf_counter() - t1))
        return loaded

    seconds, loaded = timed(once, repeats)
    publish_s = statistics.median(p for p, _ in split)
    load_s = statistics.median(lo for _, lo in split)
    return seconds, loaded, publish_s, load_s


def _collective_worker(rank: int, port: int, model_dir: str, repeats: int, bucket_bytes: int, queue) -> None:
    torch.set_num_threads(1)
    group = CollectiveGroup.join(f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=600)
    tensors = model_tensors(Path(model_dir))
    dest = {name: torch.empty_like(t) for name, t in tensors.items()}
    times = []
    for version in range(repeats):
        group.broadcast(torch.zeros(1))  # start together
        t0 = time.perf_counter()
        if rank == 0:
            broadcast_weights(group, tensors.items(), version, bucket_bytes=bucket_bytes)
        else:
            into(dest, receive_weights(group))
        group.broadcast(torch.zeros(1), src=1)  # the receiver has everything
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(("times", times))
        queue.put(("sent", digest(tensors)))
    else:
        queue.put(("received", digest(dest)))
    group.close()


def bench_collective(model_dir: Path, repeats: int, bucket_bytes: int):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_collective_worker, args=(free_port(), str(model_dir), repeats, bucket_bytes, queue), nprocs=2)
    out = dict(queue.get() for _ in range(3))
    return statistics.median(out["times"]), out["sent"] == out["received"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help=f"HF model directory (default: {DEMO_MODEL})")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported")
    parser.add_argument("--shard-mb", type=float, default=1024, help="object_store max shard size")
    parser.add_argument("--bucket-mb", type=float, default=256, help="collective bucket size")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--skip-collective", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="streamrft-bench-") as scratch:
        workdir = Path(scratch)
        model_dir = args.model
        if model_dir is None:
            if DEMO_MODEL.is_dir() and any(DEMO_MODEL.glob("*.safetensors")):
                model_dir = DEMO_MODEL
            else:
                from streamrft.engines.models import build_tiny_model

                model_dir = build_tiny_model(workdir / "tiny-model")
        tensors = model_tensors(model_dir)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        print(f"model    {model_dir}")
        print(f"tensors  {len(tensors)}, {nbytes / 1e6:.1f} MB, {'/'.join(dtypes)}; "
              f"{os.cpu_count()} CPUs; median of {args.repeats}")
        expected = digest(tensors)

        dest = {name: torch.empty_like(t) for name, t in tensors.items()}
        raw_s, raw_loaded = bench_raw(tensors, dest, workdir, args.repeats)
        raw_ok = digest(raw_loaded) == expected
        dest = {name: torch.empty_like(t) for name, t in tensors.items()}
        os_s, os_loaded, publish_s, load_s = bench_object_store(
            tensors, dest, workdir, args.repeats, int(args.shard_mb * (1 << 20))
        )
        os_ok = digest(os_loaded) == expected
        del dest, raw_loaded, os_loaded
        rows = [
            ("raw safetensors save+load", raw_s, "yes" if raw_ok else "NO"),
            ("object_store publish+load", os_s, "yes" if os_ok else "NO"),
            ("  publish", publish_s, ""),
            ("  load (verified)", load_s, ""),
        ]
        if not args.skip_collective:
            coll_s, coll_ok = bench_collective(model_dir, args.repeats, int(args.bucket_mb * (1 << 20)))
            rows.append(("collective broadcast (gloo)", coll_s, "yes" if coll_ok else "NO"))

        print()
        print(f"{'method':<30} {'seconds':>9} {'MB/s':>9} {'vs raw':>8}  identical")
        for name, seconds, ok in rows:
            rate = nbytes / 1e6 / seconds if seconds > 0 else float("inf")
            print(f"{name:<30} {seconds:>9.3f} {rate:>9.0f} {seconds / raw_s:>7.2f}x  {ok}")
        print()
        print("goal: object_store and collective each ≤ 2.00x raw")


if __name__ == "__main__":
    main()
