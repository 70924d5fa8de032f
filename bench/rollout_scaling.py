"""Rollout-worker scaling: 1, 2 and 4 worker processes in one consumer group on one broker.

Each worker is a real `streamrft rollout` process with the fake engine (a fixed latency per sample, so the work
is the same on every run and the figure measures the Kafka side: partition assignment, transactions, hand-off).
RolloutRequests are produced straight to `rollouts`, spread over its partitions. Two rates per worker count:

* whole run: from the first request produced to the last result read (start-up of the group's fetches and the
  last, partly filled engine batch of each worker included: fixed costs that do not shrink with more workers);
* steady: results read between the 10th and the 90th percentile of the run, over the time between them (the
  throughput a long-running group keeps).

Each is printed with its scaling efficiency, throughput / (workers × the 1-worker throughput of the same run);
goal >= 0.9 at 4 workers.

Usage: python bench/rollout_scaling.py [--tasks 960] [--latency 0.01] [--repeat 4] [--bootstrap HOST:PORT]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from streamrft.broker import kafka_for
from streamrft.config import load_config
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.kafka import KafkaClients
from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult

console = Console()


def run_config(bootstrap: str, name: str, latency: float):
    return load_config(overrides={
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "topics": {"rollouts": {"partitions": 16}},
        "rollout": {"engine": "fake", "fake_latency_s": latency, "metrics_port": None, "requests_per_batch": 4},
    }, env={})


def produce_requests(clients: KafkaClients, config, tasks, repeat: int, tag: str) -> None:
    producer = clients.producer()
    topic = config.topic("rollouts")
    partitions = config.topics.rollouts.partitions
    for i, task in enumerate(tasks):
        producer.produce(topic, RolloutRequest(request_id=f"{tag}-{task.task_id}", step=0,
                                               kind=RolloutKind.TRAIN, task=task, repeat_times=repeat),
                         partition=i % partitions)
    producer.flush()


def wait_results(reader, expected: int, timeout: float = 600) -> list[float]:
    """Read ``expected`` results; the time (perf_counter) each was read."""
    arrivals: list[float] = []
    deadline = time.monotonic() + timeout
    while len(arrivals) < expected:
        got = len(reader.poll(max_records=1000, timeout=0.5))
        arrivals.extend([time.perf_counter()] * got)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(arrivals)} of {expected} results after {timeout:.0f}s")
    return arrivals


@dataclass(frozen=True)
class Rates:
    whole: float  # tasks/s, first request produced -> last result read
    steady: float  # tasks/s between the 10th and the 90th percentile result


def rates(start: float, arrivals: list[float]) -> Rates:
    low, high = int(0.1 * len(arrivals)), int(0.9 * len(arrivals)) - 1
    return Rates(whole=len(arrivals) / (arrivals[-1] - start),
                 steady=(high - low) / (arrivals[high] - arrivals[low]))


def measure(bootstrap: str, workers: int, tasks: int, latency: float, repeat: int, workdir: Path) -> Rates:
    config = run_config(bootstrap, f"scale{workers}x{uuid.uuid4().hex[:6]}", latency)
    clients = KafkaClients(config, bootstrap)
    clients.ensure_topics()
    path = workdir / f"{config.name}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", by_alias=True)))
    env = {**os.environ, "STREAMRFT_LOG_LEVEL": "WARNING"}
    procs = [subprocess.Popen([sys.executable, "-m", "streamrft.cli", "rollout", str(path), "--worker-id", f"w{i}"],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / f"{config.name}-w{i}.log", "w"))
             for i in range(workers)]
    reader = clients.consumer([config.topic("results")], RolloutResult, f"{config.name}.bench")
    try:
        # Warm-up: every worker has joined the group and handled requests before the clock starts.
        produce_requests(clients, config, make_arithmetic_tasks(8 * workers, seed=99), repeat, "warm")
        wait_results(reader, 8 * workers)
        timed = make_arithmetic_tasks(tasks, seed=1)
        start = time.perf_counter()
        produce_requests(clients, config, timed, repeat, "timed")
        arrivals = wait_results(reader, tasks)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        reader.close()
        clients.close()
    return rates(start, arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=960)
    parser.add_argument("--latency", type=float, default=0.01, help="fake engine seconds per sample")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--bootstrap", default="")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    config = load_config(overrides={"kafka": {"bootstrap_servers": args.bootstrap}}, env={})
    measured: dict[int, Rates] = {}
    with kafka_for(config) as bootstrap, tempfile.TemporaryDirectory() as tmp:
        for workers in counts:
            with console.status(f"{workers} worker(s): {args.tasks} tasks x {args.repeat} samples"):
                measured[workers] = measure(bootstrap, workers, args.tasks, args.latency, args.repeat, Path(tmp))
    base = measured[counts[0]]
    ideal_per_worker = args.repeat * args.latency  # seconds of engine time per task
    table = Table(title=f"rollout scaling: fake engine {args.latency * 1000:.0f} ms/sample, repeat {args.repeat}, "
                        f"{args.tasks} tasks (engine-bound ceiling {1 / ideal_per_worker:.1f} tasks/s per worker)")
    for column in ("workers", "tasks/s, whole run", "efficiency", "tasks/s, steady (p10-p90)", "efficiency"):
        table.add_column(column, justify="right")
    for workers, rate in measured.items():
        scale = workers / counts[0]
        table.add_row(str(workers), f"{rate.whole:.1f}", f"{rate.whole / (scale * base.whole):.2f}",
                      f"{rate.steady:.1f}", f"{rate.steady / (scale * base.steady):.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
