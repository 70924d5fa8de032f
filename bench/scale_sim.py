"""Scale simulation on one machine: the whole loop (explorer, trainer, 1..N rollout workers, each a real `streamrft`
process on one embedded broker) with a model-free engine, to see where a bigger deployment would stop scaling
before one is rented, and which sync mode keeps the workers busy.

The workers' engine is the simulated one (``rollout.engine: simulated``): it decodes as vLLM does, one token per
``--step-s`` for every sample in its batch of ``--batch-seqs``, samples of uniform length between 4 and
``--max-tokens`` tokens, so a worker's ceiling is set by the engine whatever the machine, and the figures measure
everything else: step barriers, drains before weight swaps, Kafka hand-off and transactions, pacing. The trainer
is the real one on a tiny random model (CPU).

Modes (``--modes``), each at every worker count, the same tasks, one after the other in one run:

* ``fixed``          — sync fixed, interval 1, offset 1: the explorer runs one step ahead of the weights;
* ``async-w2``       — fully_async, 2 steps in flight (max_staleness 1), workers drain before each swap;
* ``async-w4``       — fully_async, 4 steps in flight (max_staleness 3), drain;
* ``async-w4-inflight`` — the same with ``rollout.weight_update: in_flight``: new weights load between engine
  steps under the running samples (each experience records the versions it spans).

Per mode and worker count (a fresh run, its own topics): ``--steps`` steps of ``--batch-size`` tasks. Reported:

* tasks/s between the 10th and the 90th percentile result (processes up and pipeline full, before the tail
  drains: with several steps in flight, step boundaries do not delimit the work done in between), its
  efficiency against N × the 1-worker rate of the same mode and against N × the engine-bound ideal (one simulated
  engine kept full, no Kafka, measured at the start of the run: the baseline);
* the batch fill: response tokens decoded in that window over the batch slots the workers' engines had;
* the explorer's median step time; CPU seconds per step of the explorer, trainer, workers and broker;
* the staleness of the trained experiences (mean and max, versions, from the trainer's metrics).

Usage: python bench/scale_sim.py [--modes fixed,async-w2,async-w4,async-w4-inflight] [--workers 1,2,4,8,16]
       [--steps 10] [--batch-size 64] [--repeat 4]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
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
from streamrft.kafka.reader import read_topic
from streamrft.schemas import Metric, RolloutResult, RolloutStatus

console = Console(width=160)
TOPICS = ("rollouts", "results", "experiences", "sync", "metrics")
WARM_UP_STEPS = 2  # CPU and broker figures per step from the end of step 1 (processes started)
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


# mode -> (sync section, explorer.max_inflight_steps, rollout.weight_update)
MODES: dict[str, tuple[dict, int, str]] = {
    "fixed": ({"style": "fixed", "interval": 1, "offset": 1}, 1, "drain"),
    "async-w2": ({"style": "fully_async", "max_staleness": 1}, 2, "drain"),
    "async-w4": ({"style": "fully_async", "max_staleness": 3}, 4, "drain"),
    "async-w4-inflight": ({"style": "fully_async", "max_staleness": 3}, 4, "in_flight"),
}


@dataclass
class Result:
    mode: str
    workers: int
    tasks_per_s: float
    step_s: float
    fill: float  # share of the workers' batch slots that decoded a token in the window
    staleness: tuple[float, float]  # trained experiences: mean, max (versions)
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

    def run_config(self, name: str, mode: str) -> dict:
        a = self.args
        sync, window, weight_update = MODES[mode]
        return {
            "name": name,
            "kafka": {"bootstrap_servers": self.broker.bootstrap_servers},
            "model": {"path": str(self.model)},
            "sync": {**sync, "max_buffered_batches": 8},
            "explorer": {"batch_size": a.batch_size, "repeat_times": a.repeat, "total_epochs": 1,
                         "max_steps": a.steps, "step_timeout_s": 600, "metrics_port": None,
                         "max_inflight_steps": window},
            "rollout": {"engine": "simulated", "simulated": {"step_s": a.step_s, "min_tokens": 4},
                        "max_batch_size": a.batch_seqs, "weight_update": weight_update,
                        "sampling": {"max_tokens": a.max_tokens}, "metrics_port": None},
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

    def measure(self, mode: str, workers: int) -> Result:
        a = self.args
        name = f"sim-{mode}-{workers}x{os.getpid() % 10000}"
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(self.run_config(name, mode)))
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
            result = self._follow(mode, procs, metrics, clients, config)
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

    def _follow(self, mode: str, procs, metrics, clients, config) -> Result:
        """Follow the run's metrics until the explorer finished every step; then the figures (see
        :func:`steady`)."""
        a = self.args
        workers = sum(1 for role in procs if role.startswith("w"))
        step_s: dict[int, float] = {}
        staleness: dict[int, tuple[float, float]] = {}  # trainer step -> (mean, max)
        first = last = None
        deadline = time.monotonic() + a.timeout_s
        with console.status(f"{mode}, {workers} worker(s): step 0 of {a.steps}") as status:
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
                        if m.step == WARM_UP_STEPS - 1:
                            first = self._snapshot(procs, clients, config)
                        status.update(f"{mode}, {workers} worker(s): step {len(step_s)} of {a.steps}")
                    elif m.role == "trainer" and m.name in ("trainer/staleness", "trainer/staleness_max"):
                        mean, most = staleness.get(m.step, (0.0, 0.0))
                        staleness[m.step] = (m.value, most) if m.name.endswith("staleness") else (mean, m.value)
        last = self._snapshot(procs, clients, config)
        rate, fill = steady(read_results(config, clients), workers, a)
        window = a.steps - WARM_UP_STEPS
        cpu = {"explorer": last.cpu["explorer"] - first.cpu["explorer"],
               "trainer": last.cpu["trainer"] - first.cpu["trainer"],
               "workers": sum(last.cpu[r] - first.cpu[r] for r in procs if r.startswith("w")),
               "broker": last.cpu["broker"] - first.cpu["broker"]}
        timed = [step_s[s] for s in range(WARM_UP_STEPS, a.steps)]
        return Result(
            mode=mode, workers=workers, tasks_per_s=rate, step_s=statistics.median(timed), fill=fill,
            staleness=(statistics.fmean(m for m, _ in staleness.values()) if staleness else float("nan"),
                       max((x for _, x in staleness.values()), default=float("nan"))),
            cpu_per_step={k: v / window for k, v in cpu.items()},
            bytes_per_step={t: (last.log_bytes[t] - first.log_bytes[t]) / window for t in TOPICS},
            records_per_step={t: (last.records[t] - first.records[t]) / window for t in TOPICS}, steps=timed)


def read_results(config, clients) -> list[RolloutResult]:
    topic = config.topic("results")
    return [clients.serde.decode(r.value, topic, RolloutResult)
            for r in read_topic(config.kafka, clients.bootstrap, topic, idle_timeout=1.0)]


def steady(results: list[RolloutResult], workers: int, args: argparse.Namespace) -> tuple[float, float]:
    """(tasks/s, batch fill) between the 10th and the 90th percentile result: the rate once the processes are up
    and the pipeline is full, before its tail drains (with several steps in flight, step boundaries do not
    delimit the work done in between). Fill: the response tokens of those results over the batch slots the
    workers' engines had meanwhile (``batch_seqs`` every ``step_s``)."""
    done = sorted((r for r in results if r.status == RolloutStatus.OK), key=lambda r: r.created_at)
    low, high = done[len(done) // 10], done[len(done) * 9 // 10]
    inside = [r for r in done if low.created_at < r.created_at <= high.created_at]
    span_s = (high.created_at - low.created_at) / 1000
    tokens = sum(r.n * r.response_length_mean for r in inside)
    return len(inside) / span_s, tokens / (workers * span_s / args.step_s * args.batch_seqs)


def engine_bound_tasks_per_s(args: argparse.Namespace) -> float:
    """The engine-bound ideal, measured in this run: one simulated engine (the workers' settings) kept full,
    with no Kafka around it: tasks/s of ``repeat`` samples."""
    from streamrft.engines.inference import SamplingParams, create_engine

    engine = create_engine("simulated", step_s=args.step_s, max_num_seqs=args.batch_seqs, min_tokens=4)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    calls = 16 * args.batch_seqs // args.repeat
    for i in range(calls):
        engine.submit(i, [[i + 3, 7, 9]], params.replace(seed=i), n=args.repeat)
    finished: list[float] = []
    while len(finished) < calls:
        finished += [time.monotonic()] * len(engine.step())
    low, high = finished[calls // 10], finished[calls * 9 // 10]  # as the loop's rate: no start, no tail
    return (calls * 9 // 10 - calls // 10) / (high - low)


def report(results: list[Result], args: argparse.Namespace, ideal: float) -> None:
    base = {r.mode: r.tasks_per_s for r in results if r.workers == 1}
    table = Table(title=f"scale simulation: simulated engine ({args.batch_seqs} seqs, {args.step_s * 1000:.0f} ms "
                        f"a step, 4-{args.max_tokens} tokens) × {args.repeat} samples, {args.batch_size} tasks/step, "
                        f"{args.partitions} rollouts partitions, {args.steps} steps; rates between the 10th and "
                        f"90th percentile result; engine-bound ideal {ideal:.2f} tasks/s per worker (measured)")
    for column in ("mode", "workers", "tasks/s", "efficiency vs 1 worker", "vs engine-bound ideal", "batch fill",
                   "step s (median)", "staleness mean / max", "CPU s/step explorer", "trainer", "workers",
                   "broker"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        one = base.get(r.mode)
        table.add_row(r.mode, str(r.workers), f"{r.tasks_per_s:.2f}",
                      f"{r.tasks_per_s / (r.workers * one):.2f}" if one else "-",
                      f"{r.tasks_per_s / (r.workers * ideal):.2f}", f"{r.fill:.2f}", f"{r.step_s:.2f}",
                      f"{r.staleness[0]:.2f} / {r.staleness[1]:.0f}",
                      f"{r.cpu_per_step['explorer']:.3f}", f"{r.cpu_per_step['trainer']:.2f}",
                      f"{r.cpu_per_step['workers']:.2f}", f"{r.cpu_per_step['broker']:.2f}")
    console.print(table)
    load = Table(title="broker load per step (records include transaction markers; bytes = log segments written)")
    load.add_column("mode")
    load.add_column("workers", justify="right")
    for topic in TOPICS:
        load.add_column(f"{topic} rec", justify="right")
        load.add_column("KiB", justify="right")
    for r in results:
        load.add_row(r.mode, str(r.workers), *[v for t in TOPICS for v in (f"{r.records_per_step[t]:.0f}",
                                                                            f"{r.bytes_per_step[t] / 1024:.0f}")])
    console.print(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.1, help="simulated engine: seconds a decode step")
    parser.add_argument("--batch-seqs", type=int, default=16, help="simulated engine: samples decoded together")
    parser.add_argument("--max-tokens", type=int, default=32, help="the longest sample (the shortest is 4)")
    parser.add_argument("--partitions", type=int, default=16, help="partitions of rollouts")
    parser.add_argument("--timeout-s", type=float, default=900, help="per mode and worker count")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    counts = [int(w) for w in args.workers.split(",")]
    results = []
    with console.status("the engine-bound ideal: one simulated engine kept full"):
        ideal = engine_bound_tasks_per_s(args)
    console.print(f"engine-bound ideal: {ideal:.2f} tasks/s per worker")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(load_config(env={}).broker) as broker:
        sim = Sim(args, broker, Path(tmp))
        for workers in counts:  # the modes side by side at each worker count: the machine's drift hits them alike
            for mode in modes:
                results.append(sim.measure(mode, workers))
                r = results[-1]
                console.print(f"{mode}, {workers} worker(s): {r.tasks_per_s:.2f} tasks/s, fill {r.fill:.2f}, steps "
                              f"{', '.join(f'{s:.2f}' for s in r.steps)} s")
        results.sort(key=lambda r: (modes.index(r.mode), r.workers))
        report(results, args, ideal)
    if args.out:
        args.out.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
