"""The monitor's memory over a run far longer than its window: does its RSS level off once it holds each role's
last ``WINDOW_STEPS`` steps (consumers/metric_table.py), or does it keep growing with the steps?

A soak kills the monitor every so often, so no life of it reaches many thousands of steps; this bench gives one
monitor process (``streamrft monitor CONFIG``, as the launcher starts it) a long run's metrics topic on the
embedded broker, fed in chunks of steps: every name the trainer, the explorer and a rollout worker declare
(streamrft/metric_catalog/topic_metrics.py, patterns left out) for each step, from one explorer, one trainer and
``--workers`` workers, and an eval round every 8 steps. After each chunk it waits until the monitor has read
everything (its group's lag 0) and has flushed (steps.csv holds the chunk's last step), then reads its RSS.

    flock /tmp/streamrft-bench.lock .venv/bin/python bench/monitor_memory.py [--steps 4096] [--chunk 256]
                                                                             [--workers 3] [--out DIR]

Prints, per chunk: steps read, metric records, the monitor's RSS, and its ratio to the RSS when the window
first filled (the baseline of the same run: everything after it should be flat). Goal: within 10 % of it
at the end. Exit code 1 when the monitor dies or falls behind for good.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from soak import rss_bytes  # bench/ is the script's folder

console = Console(stderr=True)

RUN_NAME = "monitor-memory"
EVAL_EVERY = 8
CATCH_UP_S = 300.0


def declared_names() -> dict[str, list[str]]:
    """role -> every metric name it declares for the metrics topic (patterns with placeholders left out)."""
    from streamrft.metric_catalog.topic_metrics import EXPLORER, TRAINER, WORKER

    def plain(declared):
        return [m.name for m in declared if "{" not in m.name]

    return {"explorer": plain(EXPLORER), "trainer": plain(TRAINER), "rollout": plain(WORKER)}


def step_metrics(step: int, names: dict[str, list[str]], workers: int):
    """One step's records, as a run writes them: varying values, a timestamp per role."""
    from streamrft.schemas import Metric

    at = 1_700_000_000_000 + step * 30_000
    sources = [("explorer", "explorer"), ("trainer", "trainer")] + [("rollout", f"rollout-{w}")
                                                                    for w in range(workers)]
    for role, source in sources:
        for k, name in enumerate(names[role]):
            yield Metric(source, role, name, float((step * 31 + k * 7) % 997) / 97.0, step, {}, at)
    if step % EVAL_EVERY == EVAL_EVERY - 1:
        for name in ("eval/arith/mean@4", "eval/arith/best@4", "eval/arith/accuracy"):
            yield Metric("explorer", "explorer", name, (step % 100) / 100.0, step, {}, at)


def last_step_in(path: Path) -> int:
    """The last step row of steps.csv (-1 when it is not there yet)."""
    try:
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
    except OSError:
        return -1
    return int(rows[-1][0]) if len(rows) > 1 else -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4096, help="steps of metrics in all")
    parser.add_argument("--chunk", type=int, default=256, help="steps produced at a time, then RSS is read")
    parser.add_argument("--workers", type=int, default=3, help="rollout workers whose metrics each step has")
    parser.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    from streamrft.broker import EmbeddedBroker
    from streamrft.config import load_config
    from streamrft.consumers.metric_table import WINDOW_STEPS
    from streamrft.kafka import KafkaClients
    from streamrft.launch.dashboard import group_lags

    out = (args.out or Path(tempfile.mkdtemp(prefix="monitor-memory-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "run.yaml"
    config_path.write_text(yaml.safe_dump({
        "name": RUN_NAME, "model": {"path": str(out / "no-model")},
        "monitor": {"output_dir": str(out / "run"), "metrics_port": None, "tensorboard": False}}))
    names = declared_names()
    per_step = sum(len(v) for k, v in names.items() if k != "rollout") + args.workers * len(names["rollout"])
    console.print(f"{per_step} metric records a step (+3 every {EVAL_EVERY}); the monitor keeps the last "
                  f"{WINDOW_STEPS} steps of each role")
    broker = EmbeddedBroker(load_config(config_path, env={}).broker, data_dir=out / "kafka")
    table = Table(title=f"the monitor's RSS as it reads {args.steps} steps ({per_step} records a step)")
    for column in ("steps read", "records", "RSS (MiB)", "RSS / at the window's fill", "catch-up s"):
        table.add_column(column, justify="right")
    monitor = None
    failed = False
    with broker:
        config = load_config(config_path, env={}, overrides={"kafka": {"bootstrap_servers": broker.bootstrap_servers}})
        clients = KafkaClients(config, broker.bootstrap_servers)
        clients.ensure_topics()
        env = {"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap_servers, "STREAMRFT_LOG_LEVEL": os.environ.get("STREAMRFT_LOG_LEVEL", "WARNING")}
        log = open(out / "monitor.log", "ab")
        monitor = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "monitor", str(config_path)],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **env}, cwd=out)
        producer = clients.producer()
        records, baseline = 0, None
        try:
            for first in range(0, args.steps, args.chunk):
                last = min(first + args.chunk, args.steps) - 1
                for step in range(first, last + 1):
                    for metric in step_metrics(step, names, args.workers):
                        producer.produce(config.topic("metrics"), metric)
                        records += 1
                producer.flush()
                began = time.monotonic()
                with console.status(f"the monitor reads steps {first}-{last}…"):
                    while True:
                        if monitor.poll() is not None:
                            raise RuntimeError(f"the monitor exited ({monitor.returncode}); see {out}/monitor.log")
                        if (last_step_in(out / "run" / "steps.csv") >= last
                                and group_lags(clients).get("monitor", 1) == 0):
                            break
                        if time.monotonic() - began > CATCH_UP_S:
                            raise RuntimeError(f"the monitor did not read steps {first}-{last} within "
                                               f"{CATCH_UP_S:.0f}s")
                        time.sleep(0.5)
                caught_up = time.monotonic() - began
                rss_b = rss_bytes(monitor.pid)
                rss = rss_b / 2**20 if rss_b is not None else None
                if baseline is None and last + 1 >= WINDOW_STEPS:
                    baseline = rss
                ratio = f"{rss / baseline:.3f}" if baseline and rss else "-"
                table.add_row(str(last + 1), str(records), f"{rss:.0f}" if rss else "-", ratio, f"{caught_up:.1f}")
                console.print(f"steps {last + 1}: RSS {rss:.0f} MiB ({ratio} of the window's fill)")
        except RuntimeError as exc:
            console.print(f"[red]{exc}")
            failed = True
        finally:
            monitor.terminate()
            monitor.wait(60)
            log.close()
            clients.close()
    Console().print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
