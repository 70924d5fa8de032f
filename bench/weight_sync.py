"""Weight sync cost: streamrft's transports against a raw safetensors save + load of the same tensors.

    python bench/weight_sync.py [--model DIR] [--repeats 3] [--shard-mb 1024] [--bucket-mb 256]
    python bench/weight_sync.py --lora [--lora-rank 16]     # adapter-only sync against the full model's
    python bench/weight_sync.py --url s3://BUCKET/PREFIX [--endpoint-url URL --path-style]   # an S3 store
    python bench/weight_sync.py --url s3://bench/weights --s3proxy   # against a local s3proxy it starts

* raw          — ``safetensors.torch.save_file`` then ``load_file`` of all tensors, one file (the floor).
* object_store — ``ObjectStore.publish`` (sharded safetensors + sha256 + manifest, atomic moves, retention)
                 then ``load_weights`` (manifest and every shard verified).
* sha256, blake3 — for reference: one pass over all the bytes (sha256 on one thread; BLAKE3, the shard digest,
                 on every core). object_store hashes each byte twice (publish and verify).
* collective   — ``broadcast_weights`` from rank 0 to one, then two receivers over gloo on this machine (one
                 process each), timed from the start of the broadcast until every receiver has every tensor.

With ``--lora``: the adapters of the training engine under ``model.lora`` (rank 16, every projection) published
and loaded as a LoRA run's worker does (verified load, merge into the base with ``AdapterMerger``, whole-model
copy into the engine's tensors), against the full model's object_store publish + load: seconds and bytes.

With ``--url s3://...``: object_store publish + load on that store against raw s3fs, the floor there: one
``safetensors.torch.save`` of all tensors put as one object with ``pipe_file``, then ``cat_file`` and
``safetensors.torch.load``. Credentials come from s3fs's own search (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ~/.aws); ``--s3proxy`` starts a local s3proxy (``streamrft s3 setup``) with a fresh
key instead.

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

from streamrft.engines.weights.collective import CollectiveGroup, broadcast_weights, free_port, receive_weights
from streamrft.engines.weights.object_store import ObjectStore, load_weights
from streamrft.engines.weights.safetensors_io import new_digest

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


def into(dest: dict[str, torch.Tensor], loaded) -> dict[str, torch.Tensor]:
    """What an inference engine's ``load_weights`` does with what it is given: copy into its parameters.
    Every method ends with this, so lazily mapped tensors (``load_file`` mmaps) are really read."""
    for name, tensor in loaded:
        dest[name].copy_(tensor)
    return dest


def settle() -> None:
    """Write back what earlier runs left dirty (and the discards of the files they deleted) before the clock
    starts: otherwise whichever method runs second pays for the first one's writeback, and on a disk mounted
    with ``discard`` (this machine) a deletion's discards stall the next run's block allocation. A trainer
    publishes seconds or minutes apart, by which time the kernel has written the previous version back."""
    os.sync()


def bench_file_methods(tensors, workdir: Path, repeats: int, shard_bytes: int) -> dict[str, list[float]]:
    """raw and object_store, interleaved run by run so that load from other processes hits both alike."""
    expected = digest(tensors)
    dest = {name: torch.empty_like(t) for name, t in tensors.items()}
    raw_path = workdir / "raw.safetensors"
    store = ObjectStore((workdir / "store").as_uri(), keep_last=2, max_shard_bytes=shard_bytes)
    times: dict[str, list[float]] = {"raw": [], "object_store": [], "publish": [], "load": [], "sha256": [],
                                     "blake3": []}
    for version in range(repeats):
        t0 = time.perf_counter()
        sha = hashlib.sha256()
        for t in tensors.values():
            sha.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        sha.hexdigest()
        times["sha256"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        digest_all = new_digest()
        for t in tensors.values():
            digest_all.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        digest_all.hexdigest()
        times["blake3"].append(time.perf_counter() - t0)

        settle()
        t0 = time.perf_counter()
        save_file(tensors, raw_path)
        into(dest, load_file(raw_path).items())
        times["raw"].append(time.perf_counter() - t0)
        if version == 0 and digest(dest) != expected:
            sys.exit("raw round trip changed the tensors")

        settle()
        t0 = time.perf_counter()
        pub = store.publish(tensors.items(), version)
        t1 = time.perf_counter()
        into(dest, load_weights(pub.uri, pub.sha256).items())
        t2 = time.perf_counter()
        times["object_store"].append(t2 - t0)
        times["publish"].append(t1 - t0)
        times["load"].append(t2 - t1)
        if version == 0 and digest(dest) != expected:
            sys.exit("object_store round trip changed the tensors")
        raw_path.unlink()
    return times


def bench_s3(tensors, url: str, options: dict, repeats: int, shard_bytes: int) -> dict[str, list[float]]:
    """object_store on ``url`` against raw s3fs (one object put and got), interleaved run by run."""
    import fsspec
    from safetensors.torch import load as load_bytes, save as save_bytes

    expected = digest(tensors)
    dest = {name: torch.empty_like(t) for name, t in tensors.items()}
    fs, root = fsspec.core.url_to_fs(url, **options)
    raw_path = f"{root.rstrip('/')}/raw/model.safetensors"
    store = ObjectStore(f"{url.rstrip('/')}/store", keep_last=2, max_shard_bytes=shard_bytes, storage_options=options)
    times: dict[str, list[float]] = {"raw": [], "object_store": [], "publish": [], "load": []}
    for version in range(repeats):
        t0 = time.perf_counter()
        fs.pipe_file(raw_path, save_bytes(tensors))
        into(dest, load_bytes(fs.cat_file(raw_path)).items())
        times["raw"].append(time.perf_counter() - t0)
        if version == 0 and digest(dest) != expected:
            sys.exit("raw s3fs round trip changed the tensors")
        fs.rm(raw_path)

        t0 = time.perf_counter()
        pub = store.publish(tensors.items(), version)
        t1 = time.perf_counter()
        into(dest, load_weights(pub.uri, pub.sha256, storage_options=options).items())
        t2 = time.perf_counter()
        times["object_store"].append(t2 - t0)
        times["publish"].append(t1 - t0)
        times["load"].append(t2 - t1)
        if version == 0 and digest(dest) != expected:
            sys.exit("object_store round trip on S3 changed the tensors")
    return times


def print_s3(times: dict[str, list[float]], nbytes: int, url: str) -> None:
    raw_med, raw_best = statistics.median(times["raw"]), min(times["raw"])
    print(f"\nstore    {url}")
    print(f"{'method':<32} {'median s':>9} {'best s':>8} {'MB/s':>7} {'vs raw':>7} {'(best)':>7}")
    for name, key in (("raw s3fs put+get (one object)", "raw"), ("object_store publish+load", "object_store"),
                      ("  publish", "publish"), ("  load (verified)", "load")):
        med, best = statistics.median(times[key]), min(times[key])
        print(f"{name:<32} {med:>9.3f} {best:>8.3f} {nbytes / 1e6 / med:>7.0f} {med / raw_med:>6.2f}x "
              f"{best / raw_best:>6.2f}x")
    print("\ngoal: object_store ≤ 2.00x raw s3fs (identical tensors checked on the first run of each)")


def run_s3(args, tensors, nbytes: int, workdir: Path) -> None:
    options = {}
    if args.endpoint_url:
        options["endpoint_url"] = args.endpoint_url
    if args.path_style:
        options["config_kwargs"] = {"s3": {"addressing_style": "path"}}
    if not args.s3proxy:
        times = bench_s3(tensors, args.url, options, args.repeats, int(args.shard_mb * (1 << 20)))
        print_s3(times, nbytes, args.url)
        return
    import secrets

    from streamrft.objectstore import S3Proxy

    bucket = args.url.removeprefix("s3://").split("/", 1)[0]
    (workdir / "s3" / bucket).mkdir(parents=True)
    with S3Proxy(workdir / "s3", "bench", secrets.token_hex(20)) as server:
        print(f"s3proxy  {server.endpoint_url}, started in {server.startup_s:.2f} s, "
              f"{server.rss_bytes() / 2**20:.0f} MiB resident")
        options |= {"endpoint_url": server.endpoint_url, "key": "bench", "secret": server._secret,
                    "config_kwargs": {"s3": {"addressing_style": "path"}}}
        times = bench_s3(tensors, args.url, options, args.repeats, int(args.shard_mb * (1 << 20)))
        print(f"s3proxy  {server.rss_bytes() / 2**20:.0f} MiB resident after the runs")
    print_s3(times, nbytes, args.url)


def _collective_worker(rank: int, port: int, model_dir: str, repeats: int, bucket_bytes: int, queue,
                       world: int) -> None:
    torch.set_num_threads(1)
    group = CollectiveGroup.join(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=600)
    tensors = model_tensors(Path(model_dir))
    dest = {name: torch.empty_like(t) for name, t in tensors.items()}
    times = []
    for version in range(repeats):
        group.broadcast(torch.zeros(1))  # start together
        t0 = time.perf_counter()
        if rank == 0:
            broadcast_weights(group, tensors.items(), version, bucket_bytes=bucket_bytes)
        else:
            into(dest, receive_weights(group, reuse_buffer=True))
        for receiver in range(1, world):  # every receiver has everything
            group.broadcast(torch.zeros(1), src=receiver)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(("times", times))
        queue.put(("sent", digest(tensors)))
    else:
        queue.put((f"received{rank}", digest(dest)))
    group.close()


def bench_collective(model_dir: Path, repeats: int, bucket_bytes: int, receivers: int = 1):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    world = 1 + receivers
    mp.spawn(_collective_worker, args=(free_port(), str(model_dir), repeats, bucket_bytes, queue, world),
             nprocs=world)
    out = dict(queue.get() for _ in range(2 + receivers))
    return out["times"], all(out[f"received{r}"] == out["sent"] for r in range(1, world))


def bench_lora(model_dir: Path, tensors: dict[str, torch.Tensor], workdir: Path, repeats: int, rank: int,
               shard_bytes: int) -> None:
    """Adapter-only sync (publish, verified load, merge, copy into the engine) against the full model's."""
    from streamrft.engines.lora import AdapterMerger, LoraSettings
    from streamrft.engines.training import TrainingEngine, TrainingSettings

    lora = LoraSettings(rank=rank, alpha=2.0 * rank)
    engine = TrainingEngine.from_pretrained(model_dir, TrainingSettings(), device="cpu", lora=lora)
    with torch.no_grad():  # peft starts B at zero; any values cost the same to move
        for name, tensor in engine.named_weights():
            tensor.normal_(0, 0.01)
    adapter = dict(engine.named_weights())
    merger = AdapterMerger(lora, tensors)
    dest = {name: torch.empty_like(t) for name, t in tensors.items()}
    full_store = ObjectStore((workdir / "full").as_uri(), keep_last=2, max_shard_bytes=shard_bytes)
    lora_store = ObjectStore((workdir / "lora").as_uri(), keep_last=2, max_shard_bytes=shard_bytes)
    times: dict[str, list[float]] = {key: [] for key in ("full", "lora", "lora publish", "lora load", "merge")}
    sizes = {}
    for version in range(repeats):
        settle()
        t0 = time.perf_counter()
        pub = full_store.publish(tensors.items(), version)
        into(dest, load_weights(pub.uri, pub.sha256).items())
        times["full"].append(time.perf_counter() - t0)
        sizes["full"] = pub.nbytes
        settle()
        t0 = time.perf_counter()
        pub = lora_store.publish(adapter.items(), version, metadata=engine.publish_metadata())
        t1 = time.perf_counter()
        loaded = load_weights(pub.uri, pub.sha256)
        t2 = time.perf_counter()
        into(dest, merger.merge(loaded).items())
        t3 = time.perf_counter()
        times["lora"].append(t3 - t0)
        times["lora publish"].append(t1 - t0)
        times["lora load"].append(t2 - t1)
        times["merge"].append(t3 - t2)
        sizes["lora"] = pub.nbytes
    full = statistics.median(times["full"])
    print(f"\nLoRA rank {rank} on {', '.join(lora.target_modules)}: "
          f"{sum(t.numel() for t in adapter.values()) / 1e6:.2f} M adapter parameters; median of {repeats}")
    print(f"{'method':<40} {'median s':>9} {'MB':>9} {'vs full':>8}")
    for name, key, size in (("full model: publish + load", "full", sizes["full"]),
                            ("adapter: publish + load + merge + copy", "lora", sizes["lora"]),
                            ("  publish", "lora publish", None), ("  load (verified)", "lora load", None),
                            ("  merge + whole-model copy", "merge", None)):
        med = statistics.median(times[key])
        print(f"{name:<40} {med:>9.3f} {size / 1e6 if size else float('nan'):>9.2f} {med / full:>7.2f}x")
    print(f"bytes on the wire: adapter {sizes['lora'] / sizes['full']:.4f} of the full model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help=f"HF model directory (default: {DEMO_MODEL})")
    parser.add_argument("--repeats", type=int, default=5, help="runs per method; the median is reported")
    parser.add_argument("--shard-mb", type=float, default=256, help="object_store max shard size")
    parser.add_argument("--bucket-mb", type=float, default=64, help="collective bucket size")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--skip-collective", action="store_true")
    parser.add_argument("--lora", action="store_true", help="adapter-only sync against the full model's instead")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--url", default=None, help="an s3:// store: object_store there against raw s3fs")
    parser.add_argument("--endpoint-url", default=None, help="--url: an S3-compatible server's endpoint")
    parser.add_argument("--path-style", action="store_true", help="--url: path-style addressing")
    parser.add_argument("--s3proxy", action="store_true", help="--url: start a local s3proxy for the run")
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
        if args.url:
            run_s3(args, tensors, nbytes, workdir)
            return
        if args.lora:
            bench_lora(model_dir, tensors, workdir, args.repeats, args.lora_rank, int(args.shard_mb * (1 << 20)))
            return
        times = bench_file_methods(tensors, workdir, args.repeats, int(args.shard_mb * (1 << 20)))
        rows = [
            ("raw safetensors save+load", times["raw"], "yes"),
            ("object_store publish+load", times["object_store"], "yes"),
            ("  publish", times["publish"], ""),
            ("  load (verified)", times["load"], ""),
            ("(sha256 of all bytes, 1 thread)", times["sha256"], ""),
            ("(blake3 of all bytes, all cores)", times["blake3"], ""),
        ]
        if not args.skip_collective:
            for receivers in (1, 2):
                coll, coll_ok = bench_collective(model_dir, args.repeats, int(args.bucket_mb * (1 << 20)), receivers)
                rows.append((f"collective (gloo), {receivers} receiver(s)", coll, "yes" if coll_ok else "NO"))

        raw_med, raw_best = statistics.median(times["raw"]), min(times["raw"])
        print()
        print(f"{'method':<32} {'median s':>9} {'best s':>8} {'MB/s':>7} {'vs raw':>7} {'(best)':>7}  identical")
        for name, runs, ok in rows:
            med, best = statistics.median(runs), min(runs)
            print(f"{name:<32} {med:>9.3f} {best:>8.3f} {nbytes / 1e6 / med:>7.0f} {med / raw_med:>6.2f}x "
                  f"{best / raw_best:>6.2f}x  {ok}")
        print()
        print("goal: object_store and collective each ≤ 2.00x raw. 'vs raw' compares medians, '(best)' the fastest")
        print("runs (less sensitive to other load on the machine: load average now "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs).")


if __name__ == "__main__":
    main()
