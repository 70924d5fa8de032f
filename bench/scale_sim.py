"""Scale simulation on one machine: the whole loop (explorer, trainer, 1..N rollout workers, each a real `streamrft`
process on one embedded broker) with the fake inference engine, to see where a bigger deployment would stop
scaling before one is rented.

The fake engine sleeps ``--latency`` per sample and runs a worker's samples one after another, so a worker's
ceiling is 1 / (repeat × latency) tasks/s whatever the machine, and the figures measure everything else: the
explorer's step barrier and bookkeeping, Kafka hand-off and transactions, partition assignment. The trainer is
the real one on a tiny random model (CPU), paced ``fully_async`` one step behind, so it overlaps the rollouts.

Per worker count (a fresh run, its own topics): ``--steps`` steps of ``--batch-size`` tasks; step 0 is warm-up
(processes starting), the window is from its end to the end of the last step. Reported:

* tasks/s in the window and the scaling efficiency rate / (N × the 1-worker rate) (the baseline, same run);
* the explorer's median step time next to the engine-bound ideal ⌈B / N⌉ · repeat · latency; the difference is
  the loop's overhead per step (hand-off, transactions, the barrier, pacing);
* CPU seconds per step of the explorer, the trainer, all workers together and the broker JVM (``/proc``);
* records and bytes the broker wrote per step on each topic (its log segments), transaction markers included.

The README's "Scale" section extrapolates these to 256 workers / 64 partitions.

Usage: python bench/scale_sim.py [--workers 1,2,4,8,16] [--steps 5] [--batch-size 64] [--repeat 4]
       [--latency 0.1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from streamrft.broker import EmbeddedBroker
from streamrft.config import load_config
from streamrft.kafka import KafkaClients
from streamrft.schemas import Metric

console = Console(width=160)
TOPICS = ("rollouts", "results", "experiences", "sync", "metrics")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (OSError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Snapshot:
    at: float
    cpu: dict[str, float]
    log_bytes: dict[str, int]
    records: dict[str, int]


@dataclass
class Result:
    workers: int
    tasks_per_s: float
    step_s: float
    ideal_step_s: float
    cpu_per_step: dict[str, float]
    bytes_per_step: dict[str, float]
    records_per_step: dict[str, float]
    steps: list[float] = field(default_factory=list)


class Sim:
    def __init__(self, args: argparse.Namespace, broker: EmbeddedBroker, workdir: Path) -> None:
        self.args = args
        self.broker = broker
        self.workdir = workdir
        from streamrft.engines.models import build_tiny_model

        self.model = workdir / "model"
        if not self.model.exists():
            build_tiny_model(self.model, seed=0)

    def run_config(self, name: str) -> dict:
        a = self.args
        return {
            "name": name,
            "kafka": {"bootstrap_servers": self.broker.bootstrap_servers},
            "model": {"path": str(self.model)},
            "sync": {"style": "fully_async", "max_staleness": 1},
            "explorer": {"batch_size": a.batch_size, "repeat_times": a.repeat, "total_epochs": 1,
                         "max_steps": a.steps, "step_timeout_s": 600, "metrics_port": None},
            "rollout": {"engine": "fake", "fake_latency_s": a.latency, "sampling": {"max_tokens": 4},
                        "metrics_port": None},
            "trainer": {"lr": 1e-3, "micro_batch_size": 64, "device": "cpu", "save_interval": 1000,
                        "checkpoint_dir": str(self.workdir / name / "checkpoints"), "metrics_port": None},
            "topics": {"rollouts": {"partitions": a.partitions}},
        }

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")}
        env.update({"STREAMRFT_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                    "TOKENIZERS_PARALLELISM": "false"})
        return env

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "streamrft.cli", *args], env=self._env(), cwd=self.workdir,
                                stdout=log, stderr=subprocess.STDOUT)

    def measure(self, workers: int) -> Result:
        a = self.args
        name = f"sim{workers}x{os.getpid() % 10000}"
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(self.run_config(name)))
        config = load_config(config_path, env={})
        clients = KafkaClients(config, self.broker.bootstrap_servers)
        clients.ensure_topics()
        tasks = self.workdir / f"{name}-tasks.jsonl"
        tasks.write_text("".join(json.dumps({"question": f"What is {i % 97} + {i % 89}?", "answer": i % 97 + i % 89})
                                 + "\n" for i in range(a.batch_size * a.steps)))
        subprocess.run([sys.executable, "-m", "streamrft.cli", "tasks", "produce", str(tasks), "-c",
                        str(config_path)], env=self._env(), check=True, capture_output=True)
        procs = {"trainer": self._start(f"{name}-trainer", "train", str(config_path))}
        for i in range(workers):
            procs[f"w{i}"] = self._start(f"{name}-w{i}", "rollout", str(config_path), "--worker-id", f"w{i}")
        procs["explorer"] = self._start(f"{name}-explorer", "explorer", str(config_path))
        metrics = clients.consumer([config.topic("metrics")], Metric, f"{name}.sim", subscribe=False,
                                   dead_letters=False)
        metrics.assign(clients.offsets(config.topic("metrics"), "start"))
        try:
            result = self._follow(procs, metrics, clients, config)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            metrics.close()
            clients.close()
        return result

    def _snapshot(self, procs: dict[str, subprocess.Popen], clients, config) -> Snapshot:
        cpu = {"broker": cpu_seconds(self.broker.pid) or 0.0}
        for role, proc in procs.items():
            cpu[role] = cpu_seconds(proc.pid) or 0.0
        log_bytes = {t: sum(f.stat().st_size for f in self.broker.data_dir.glob(f"*/{config.topic(t)}-*/*.log"))
                     for t in TOPICS}
        records = {t: sum(clients.offsets(config.topic(t), "end").values()) for t in TOPICS}
        return Snapshot(time.monotonic(), cpu, log_bytes, records)

    def _follow(self, procs, metrics, clients, config) -> Result:
        a = self.args
        workers = sum(1 for role in procs if role.startswith("w"))
        step_s: dict[int, float] = {}
        first = last = None
        deadline = time.monotonic() + a.timeout_s
        with console.status(f"{workers} worker(s): step 0 of {a.steps}") as status:
            while len(step_s) < a.steps:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{workers} workers: {len(step_s)} of {a.steps} steps in {a.timeout_s:.0f}s; "
                                       f"logs in {self.workdir}")
                for role, proc in procs.items():
                    if proc.poll() not in (None, 0):
                        raise RuntimeError(f"{role} exited {proc.returncode}; see {self.workdir}")
                for delivered in metrics.poll(500, 0.2):
                    m = delivered.record
                    if m.role == "explorer" and m.name == "time/step_s":
                        step_s[m.step] = m.value
                        if m.step == 0:
                            first = self._snapshot(procs, clients, config)
                        elif len(step_s) == a.steps:
                            last = self._snapshot(procs, clients, config)
                        status.update(f"{workers} worker(s): step {len(step_s)} of {a.steps}")
        window = a.steps - 1
        elapsed = last.at - first.at
        cpu = {"explorer": last.cpu["explorer"] - first.cpu["explorer"],
               "trainer": last.cpu["trainer"] - first.cpu["trainer"],
               "workers": sum(last.cpu[r] - first.cpu[r] for r in procs if r.startswith("w")),
               "broker": last.cpu["broker"] - first.cpu["broker"]}
        timed = [step_s[s] for s in range(1, a.steps)]
        return Result(
            workers=workers, tasks_per_s=a.batch_size * window / elapsed, step_s=statistics.median(timed),
            ideal_step_s=math.ceil(a.batch_size / workers) * a.repeat * a.latency,
            cpu_per_step={k: v / window for k, v in cpu.items()},
            bytes_per_step={t: (last.log_bytes[t] - first.log_bytes[t]) / window for t in TOPICS},
            records_per_step={t: (last.records[t] - first.records[t]) / window for t in TOPICS}, steps=timed)


def report(results: list[Result], args: argparse.Namespace) -> None:
    base = results[0].tasks_per_s / results[0].workers
    ceiling = 1 / (args.repeat * args.latency)
    table = Table(title=f"scale simulation: fake engine {args.latency * 1000:.0f} ms/sample × {args.repeat}, "
                        f"{args.batch_size} tasks/step, {args.partitions} rollouts partitions, "
                        f"{args.steps - 1} timed steps; ceiling {ceiling:.2f} tasks/s per worker")
    for column in ("workers", "tasks/s", "efficiency", "step s (median)", "ideal step s", "overhead s/step",
                   "CPU s/step explorer", "trainer", "workers", "broker"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r.workers), f"{r.tasks_per_s:.2f}", f"{r.tasks_per_s / (r.workers * base):.2f}",
                      f"{r.step_s:.2f}", f"{r.ideal_step_s:.2f}", f"{r.step_s - r.ideal_step_s:.2f}",
                      f"{r.cpu_per_step['explorer']:.3f}", f"{r.cpu_per_step['trainer']:.2f}",
                      f"{r.cpu_per_step['workers']:.2f}", f"{r.cpu_per_step['broker']:.2f}")
    console.print(table)
    load = Table(title="broker load per step (records include transaction markers; bytes = log segments written)")
    load.add_column("workers", justify="right")
    for topic in TOPICS:
        load.add_column(f"{topic} rec", justify="right")
        load.add_column("KiB", justify="right")
    for r in results:
        load.add_row(str(r.workers), *[v for t in TOPICS for v in (f"{r.records_per_step[t]:.0f}",
                                                                    f"{r.bytes_per_step[t] / 1024:.0f}")])
    console.print(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.1, help="fake engine seconds per sample")
    parser.add_argument("--partitions", type=int, default=16, help="partitions of rollouts")
    parser.add_argument("--timeout-s", type=float, default=900, help="per worker count")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(load_config(env={}).broker) as broker:
        sim = Sim(args, broker, Path(tmp))
        for workers in counts:
            results.append(sim.measure(workers))
            console.print(f"{workers} worker(s): {results[-1].tasks_per_s:.2f} tasks/s, steps "
                          f"{', '.join(f'{s:.2f}' for s in results[-1].steps)} s")
        report(results, args)


if __name__ == "__main__":
    main()
