"""The rollout worker with continuous batching vs batch-at-a-time, on the same requests in the same run.

    flock /tmp/streamrft-bench.lock python bench/continuous_batching.py [--model DIR] [--requests 48] [--n 1]
        [--concurrency 8] [--max-tokens 128] [--engine vllm|transformers] [--rounds 2]

One real ``RolloutWorker`` on the embedded broker and one engine (built once, shared by both modes): RolloutRequests
of the demo's arithmetic tasks are produced straight to ``rollouts``; the clock runs from the worker's start to its
last request committed. Sampling is seeded per request (``rollout.sampling.seed``), so both modes generate
the same samples. Both modes keep ``--concurrency`` requests on the engine: ``batch`` takes that many at
a time and commits them together once the slowest sample is done; ``continuous`` starts the next request as soon
as one is committed. The demo model at temperature 1 answers at mixed lengths (some in a few tokens, some at
``--max-tokens``): the table shows the spread. A request lasts as long as its longest sample, so the mix is
of requests with one sample each by default (``--n 1``); with ``--n 4`` nearly every request of the demo model
has a sample that runs to ``--max-tokens``, and both modes drain alike. Modes alternate for ``--rounds`` rounds (noisy machines); the
figure is the ratio of medians (goal: continuous ≥ 1.2 × batch).
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrft.broker import kafka_for
from streamrft.config import load_config
from streamrft.consumers.rollout import RolloutWorker
from streamrft.engines.inference import create_engine
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.lifecycle import StopSignal
from streamrft.schemas import Experience, RolloutKind, RolloutRequest

DEMO_MODEL = Path.home() / ".cache" / "streamrft" / "models" / "smollm2-135m-instruct"
console = Console(width=140)


def one_round(bootstrap: str, engine, mode: str, args) -> tuple[float, list[int]]:
    """Seconds for the worker to commit every request, and the response lengths it produced."""
    config = load_config(overrides={
        "name": f"cb{uuid.uuid4().hex[:8]}", "kafka": {"bootstrap_servers": bootstrap},
        "model": {"path": str(args.model)},
        "rollout": {"engine": args.engine, "batching": mode, "requests_per_batch": args.concurrency,
                    "requests_in_flight": args.concurrency, "metrics_port": None,
                    "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens, "seed": 0}},
    }, env={})
    clients = KafkaClients(config, bootstrap)
    clients.ensure_topics()
    producer = clients.producer()
    for task in make_arithmetic_tasks(args.requests, seed=7):
        producer.produce(config.topic("rollouts"), RolloutRequest(
            request_id=task.task_id, step=0, kind=RolloutKind.TRAIN, task=task, repeat_times=args.n))
    producer.flush()
    worker = RolloutWorker(config, clients, StopSignal(), f"bench-{mode}", engine=engine)
    try:
        started = time.perf_counter()
        worker.run(max_requests=args.requests)
        seconds = time.perf_counter() - started
    finally:
        worker.close()
    lengths = [e.response_length for e in (
        clients.serde.decode(raw.value, raw.topic, Experience)
        for raw in read_to_end(config.kafka, bootstrap, config.topic("experiences")))]
    assert len(lengths) == args.requests * args.n, f"{len(lengths)} samples, {args.requests * args.n} expected"
    return seconds, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--engine", default="vllm", choices=("vllm", "transformers"))
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--n", type=int, default=1, help="samples per request (a request lasts as long as its "
                                                         "longest sample: with many, every request lasts ~max)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not args.model.is_dir():
        raise SystemExit(f"no model at {args.model}: prepare the demo model with scripts/setup.sh --demo")

    kwargs = ({"dtype": "float32", "kv_cache_gib": 2, "max_num_seqs": 256, "max_model_len": 1024}
              if args.engine == "vllm" else {"device": "cpu"})
    with console.status(f"{args.engine} engine on {args.model.name}"):
        engine = create_engine(args.engine, args.model, **kwargs)
    times: dict[str, list[float]] = {"batch": [], "continuous": []}
    lengths: dict[str, list[int]] = {}
    config = load_config(overrides={}, env={})
    with kafka_for(config) as bootstrap:
        for round_ in range(args.rounds):
            for mode in ("batch", "continuous") if round_ % 2 == 0 else ("continuous", "batch"):
                with console.status(f"round {round_ + 1}/{args.rounds}: {mode}"):
                    seconds, lengths[mode] = one_round(bootstrap, engine, mode, args)
                times[mode].append(seconds)
                console.print(f"round {round_ + 1} {mode}: {seconds:.1f} s")
    engine.close()

    table = Table(title=f"rollout worker, {args.engine}, {args.requests} requests × n={args.n}, "
                        f"{args.concurrency} requests on the engine, ≤{args.max_tokens} tokens, {args.model.name}")
    for column in ("batching", "s (median)", "tokens", "tokens/s", "requests/s", "length p10/p50/p90/max",
                   "× batch"):
        table.add_column(column, justify="right")
    base = statistics.median(times["batch"])
    for mode in ("batch", "continuous"):
        seconds, tokens = statistics.median(times[mode]), sum(lengths[mode])
        q = statistics.quantiles(lengths[mode], n=10)
        table.add_row(mode, f"{seconds:.1f}", str(tokens), f"{tokens / seconds:.0f}",
                      f"{args.requests / seconds:.2f}", f"{q[0]:.0f}/{q[4]:.0f}/{q[8]:.0f}/{max(lengths[mode])}",
                      f"{base / seconds:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
