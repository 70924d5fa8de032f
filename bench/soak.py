"""Soak: a long `streamrft run` on a replicated 3-node cluster while a role process is SIGKILLed every few minutes
and a broker node restarted every so often; then the exactly-once checks of ``chaos.py`` and each role's memory.

What runs: the harness starts the cluster (3 KRaft nodes, every topic replicated 3 times, min.insync.replicas 2)
and `streamrft run` against it, as an operator runs it in production (the launcher starts and supervises the
explorer, the trainer, the monitor and the rollout workers; the fake inference engine and a tiny random model
trained on CPU). The harness is also the run's task producer: the taskset streams (``total_epochs: null``) and
`streamrft tasks produce` adds whole steps of tasks whenever fewer than ``AHEAD_STEPS`` are waiting, so the run
lasts as long as the soak and every step is full.

What it does to the run during ``--minutes``: every ``--kill-every-s`` (jittered) a SIGKILL of the next role of a
shuffled deck (each round kills every role once: explorer, trainer, monitor, each worker), which `streamrft run`
must notice and restart by itself; every ``--broker-every-s`` a SIGKILL of a random broker node, down for 5 s,
back on its data, the cluster in sync again before anything else happens to the brokers.
Every ``SAMPLE_S`` it samples each process's resident memory (/proc) and the consumer groups' lags.

Then it stops producing, waits until the explorer has finished every produced step and the trainer has caught up,
stops the run with SIGINT (the clean, resumable stop), and checks from read_committed reads of every topic and the
trainer's audit (the invariants of ``chaos.py``): every task rolled out exactly once, every OK result's
experiences exactly once, nothing trained twice, nothing lost, the trainer's steps contiguous; and that every kill
was a restart on the launcher's own ``streamrft_role_restarts_total``.

Memory: a process's RSS is read ``--warmup-s`` into its life (imports, model, first batches) and at its end;
restarted roles have several lives, and the table gives each role's longest. Goal: flat within 10 %.

Usage: python bench/soak.py --minutes 60 [--seed 0] [--workers 3] [--kill-every-s 180] [--broker-every-s 900]
                            [--out runs/soak-<seed>]
Exit code 1 when an invariant fails or the run did not finish. Figures: OUT/soak.json; logs: OUT/run/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from chaos import TrainerLifetime, check, observe_topics, print_violations  # bench/ is the script's folder

console = Console(stderr=True)

RUN_NAME = "soak"
AHEAD_STEPS = 3  # tasks waiting in the topic, in steps: the explorer never waits on the producer
CHUNK_STEPS = 5  # steps of tasks per `streamrft tasks produce`
SAMPLE_S = 30.0
STEP_DONE = re.compile(r"explorer: step (\d+) done")
CATCH_UP_S = 900.0  # after the window: how long the run may take to finish what was produced


# ---------------------------------------------------------------------------------------------------------------
# memory: pure bookkeeping over samples, so a unit test can drive it
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Life:
    """One process of a role, from the harness's first sight of its pid to its last."""

    role: str
    pid: int
    first_seen: float
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, RSS bytes)
    live_heap: list[int] = field(default_factory=list)  # a JVM's heap in use right after a full GC: start, end

    def duration_s(self) -> float:
        return self.samples[-1][0] - self.first_seen if self.samples else 0.0

    def rss_after(self, warmup_s: float) -> int | None:
        """The first sample at least ``warmup_s`` into this life."""
        return next((rss for t, rss in self.samples if t - self.first_seen >= warmup_s), None)

    def rss_end(self) -> int | None:
        return self.samples[-1][1] if self.samples else None


class MemoryLedger:
    def __init__(self):
        self.lives: dict[tuple[str, int], Life] = {}

    def sample(self, now: float, rss_by_role: dict[str, tuple[int, int]]) -> None:
        """``rss_by_role``: role -> (pid, RSS bytes) of its current process."""
        for role, (pid, rss) in rss_by_role.items():
            life = self.lives.setdefault((role, pid), Life(role, pid, now))
            life.samples.append((now, rss))

    def longest(self, role: str) -> Life | None:
        lives = [life for life in self.lives.values() if life.role == role]
        return max(lives, key=Life.duration_s, default=None)

    def roles(self) -> list[str]:
        return sorted({life.role for life in self.lives.values()})

    def lives_of(self, role: str) -> int:
        return sum(1 for life in self.lives.values() if life.role == role)


def growth(start: int | None, end: int | None) -> float | None:
    """End over start, minus one (0.05 = grew 5 %)."""
    if not start or end is None:
        return None
    return end / start - 1.0


# ---------------------------------------------------------------------------------------------------------------
# the processes of the run
# ---------------------------------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


HEAP_USED = re.compile(r"heap\s+total \d+K, used (\d+)K")


def jvm_live_heap(pid: int) -> int | None:
    """The bytes a JVM's heap holds right after a full GC: what it keeps, not what it has touched. A JVM's RSS
    grows while the collector first touches its heap's pages, up to -Xmx; this tells that from a leak."""
    try:
        subprocess.run(["jcmd", str(pid), "GC.run"], capture_output=True, timeout=60, check=True)
        info = subprocess.run(["jcmd", str(pid), "GC.heap_info"], capture_output=True, text=True, timeout=60,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = HEAP_USED.search(info)
    return int(found.group(1)) * 1024 if found else None


def role_pids(launcher_pid: int) -> dict[str, int]:
    """role name -> pid of the launcher's live role processes (``python -m streamrft.cli <role> CONFIG ...``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid or stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        name = role_name([a.decode(errors="replace") for a in argv if a])
        if name is not None:
            found[name] = int(entry.name)
    return found


def role_name(argv: list[str]) -> str | None:
    """The launcher's name for a role process from its command line (as streamrft/commands/run.py names them)."""
    if "streamrft.cli" not in argv:
        return None
    args = argv[argv.index("streamrft.cli") + 1:]
    if not args:
        return None
    if args[0] == "rollout" and "--worker-id" in args:
        return args[args.index("--worker-id") + 1]
    return {"train": "trainer"}.get(args[0], args[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_restarts(port: int) -> dict[str, int]:
    """``streamrft_role_restarts_total`` per role from the launcher's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.findall(r'^streamrft_role_restarts_total\{role="([^"]+)"\} ([0-9.e+]+)$', text, re.M)
    return {role: int(float(value)) for role, value in found}


# ---------------------------------------------------------------------------------------------------------------
# the soak
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakSettings:
    out: Path
    minutes: float = 60.0
    seed: int = 0
    workers: int = 3
    kill_every_s: float = 180.0
    broker_every_s: float = 900.0
    broker_down_s: float = 5.0
    warmup_s: float = 120.0
    batch_size: int = 4
    repeat_times: int = 2
    fake_latency_s: float = 0.2
    save_interval: int = 2
    heap: str = "384m"


@dataclass
class Soak:
    kills: dict[str, int] = field(default_factory=dict)
    broker_restarts: int = 0
    produced_steps: int = 0
    steps_done: int = 0
    finished: bool = False
    failure: str | None = None
    launcher_exit: int | None = None
    lags: dict[str, list[int]] = field(default_factory=dict)  # group -> sampled total lag
    trainer_lifetimes: list[TrainerLifetime] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    window_s: float = 0.0
    catch_up_s: float = 0.0


class SoakRun:
    def __init__(self, settings: SoakSettings):
        self.s = settings
        self.out = Path(settings.out).resolve()
        self.run_dir = self.out / "run"
        self.config_path = self.out / "run.yaml"
        self.rng = random.Random(settings.seed)
        self.soak = Soak()
        self.memory = MemoryLedger()
        self.broker = None
        self.launcher: subprocess.Popen | None = None
        self.metrics_port = free_port()
        self.began = time.monotonic()
        self._deck: list[str] = []
        self._broker_thread: threading.Thread | None = None
        self._broker_error: BaseException | None = None
        self._clients = None

    # -- set-up ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        if self.out.exists() and any(self.out.iterdir()):
            raise SystemExit(f"{self.out} is not empty; give --out a new directory")
        self.out.mkdir(parents=True, exist_ok=True)
        from streamrft.engines.models import build_tiny_model

        with console.status("building the tiny model…"):
            build_tiny_model(self.out / "model", seed=self.s.seed)
        self.config_path.write_text(yaml.safe_dump(self._run_config()))

    def _run_config(self) -> dict:
        s = self.s
        return {
            "name": RUN_NAME,
            "model": {"path": str(self.out / "model")},
            "sync": {"style": "fixed", "interval": 1, "offset": 1, "max_staleness": 2},
            "explorer": {"batch_size": s.batch_size, "repeat_times": s.repeat_times, "total_epochs": None,
                         "step_timeout_s": 300, "metrics_port": None},
            "rollout": {"engine": "fake", "fake_latency_s": s.fake_latency_s, "requests_per_batch": 2,
                        "transaction_timeout_ms": 10_000, "sampling": {"max_tokens": 6}, "metrics_port": None},
            "trainer": {"lr": 1e-3, "micro_batch_size": 8, "save_interval": s.save_interval, "device": "cpu",
                        "checkpoint_dir": str(self.out / "checkpoints"), "metrics_port": None},
            "monitor": {"output_dir": str(self.run_dir), "metrics_port": None, "tensorboard": False},
            "broker": {"nodes": 3, "heap": s.heap},
            "launch": {"rollout_workers": s.workers, "rollout_metrics_port_base": 0,
                       "metrics_port": self.metrics_port},
            "topics": {"rollouts": {"partitions": 2 * s.workers}, "experiences": {"partitions": 2}},
        }

    def config(self):
        from streamrft.config import load_config

        return load_config(self.config_path, env={}, overrides={"kafka": {"bootstrap_servers": self.bootstrap}})

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")}
        env.update({"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap, "STREAMRFT_LOG_LEVEL": "INFO",
                    "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"})
        return env

    def start_cluster(self) -> None:
        from streamrft.broker import EmbeddedBroker
        from streamrft.config import load_config

        self.broker = EmbeddedBroker(load_config(self.config_path, env={}).broker, data_dir=self.out / "kafka",
                                     keep_data=True)
        with console.status("starting the 3-node cluster…"):
            self.broker.start()
        console.print(f"{self.broker.kind} at {self.bootstrap}")
        from streamrft.kafka import KafkaClients

        self._clients = KafkaClients(self.config(), self.bootstrap)
        self._clients.ensure_topics()

    def produce_steps(self, steps: int) -> None:
        """Whole steps of tasks, as a user's producer adds them to a streaming taskset."""
        first = self.soak.produced_steps * self.s.batch_size
        rows = [{"question": f"What is {i % 9} + {i % 7}?", "answer": i % 9 + i % 7, "id": f"soak-{i}"}
                for i in range(first, first + steps * self.s.batch_size)]
        path = self.out / "tasks" / f"tasks-{first:07d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = subprocess.run([sys.executable, "-m", "streamrft.cli", "tasks", "produce", str(path), "-c",
                                 str(self.config_path), "--id-key", "id"], env=self._env(), capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"producing {path} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
        self.soak.produced_steps += steps

    def start_run(self) -> None:
        log = open(self.out / "launcher.log", "ab")
        self.launcher = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "run", str(self.config_path),
                                          "--no-dashboard"], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self._env(), cwd=self.out,
                                         start_new_session=True)
        log.close()

    # -- the window -----------------------------------------------------------------------------------------
    def run_window(self) -> None:
        s = self.s
        window_end = self.began + 60 * s.minutes
        next_kill = None
        next_broker = self.began + s.broker_every_s
        next_sample = 0.0
        with Progress(TextColumn("[bold]soak"), BarColumn(), TextColumn("{task.fields[figures]}"),
                      TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("soak", total=60 * s.minutes, figures="")
            while (now := time.monotonic()) < window_end:
                self._check_launcher()
                self._keep_tasks_ahead()
                if next_kill is None and self.soak.steps_done >= 1:  # every role is up: the kills begin
                    next_kill = now + self._jitter(s.kill_every_s)
                if next_kill is not None and now >= next_kill:
                    self._kill_next_role()
                    next_kill = time.monotonic() + self._jitter(s.kill_every_s)
                if now >= next_broker and not self._broker_busy():
                    self._restart_broker_node()
                    next_broker = now + self._jitter(s.broker_every_s)
                if self._broker_error is not None:
                    raise RuntimeError(f"a broker restart failed: {self._broker_error!r}")
                if now >= next_sample:
                    self._sample()
                    next_sample = now + SAMPLE_S
                progress.update(bar, completed=now - self.began, figures=self._figures())
                time.sleep(0.5)
        self.soak.window_s = time.monotonic() - self.began

    def _jitter(self, mean_s: float) -> float:
        return mean_s * self.rng.uniform(0.7, 1.3)

    def _figures(self) -> str:
        return (f"steps {self.soak.steps_done}/{self.soak.produced_steps}, kills {sum(self.soak.kills.values())}, "
                f"broker restarts {self.soak.broker_restarts}")

    def _check_launcher(self) -> None:
        if self.launcher.poll() is not None:
            tail = "\n".join((self.out / "launcher.log").read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"streamrft run exited ({self.launcher.returncode}) during the soak:\n{tail}")
        self.soak.steps_done = self._explorer_steps_done()

    def _explorer_steps_done(self) -> int:
        path = self.run_dir / "logs" / "explorer.log"
        if not path.exists():
            return 0
        steps = [int(m.group(1)) for m in STEP_DONE.finditer(path.read_text(errors="replace"))]
        return max(steps) + 1 if steps else 0

    def _keep_tasks_ahead(self) -> None:
        if self.soak.produced_steps - self.soak.steps_done < AHEAD_STEPS:
            self.produce_steps(CHUNK_STEPS)

    def _kill_next_role(self) -> None:
        pids = role_pids(self.launcher.pid)
        if not self._deck:
            self._deck = sorted(pids)
            self.rng.shuffle(self._deck)
        role = self._deck.pop()
        pid = pids.get(role)
        if pid is None:  # waiting out its back-off after the previous kill: the next in the deck instead
            self.event(f"{role} is not running now; not killed this time")
            return
        os.killpg(pid, signal.SIGKILL)
        self.soak.kills[role] = self.soak.kills.get(role, 0) + 1
        self.event(f"SIGKILL {role} (pid {pid})")
        if role == "trainer":
            self._snapshot_trainer(len(self.soak.trainer_lifetimes) + 1)

    def _snapshot_trainer(self, lifetime: int) -> None:
        """Before the restarted trainer truncates its audit to its checkpoint: what this lifetime left behind
        (chaos.py's rule 4 tells committed entries from rolled-back ones with it)."""
        from streamrft.consumers.trainer.checkpoints import Checkpoints

        checkpoints = Checkpoints(self.out / "checkpoints", keep=1)
        steps = checkpoints.steps()
        self.soak.trainer_lifetimes.append(TrainerLifetime(lifetime, "killed", checkpoints.audit(),
                                                           steps[-1] if steps else -1))

    def _broker_busy(self) -> bool:
        return self._broker_thread is not None and self._broker_thread.is_alive()

    def _restart_broker_node(self) -> None:
        node = self.rng.choice([n.node_id for n in self.broker.nodes])

        def restart() -> None:
            try:
                self.event(f"SIGKILL broker node {node}")
                self.broker.kill_node(node)
                time.sleep(self.s.broker_down_s)
                self.broker.start_node(node)
                self.broker.wait_in_sync(timeout=300)
                self.soak.broker_restarts += 1
                self.event(f"broker node {node} back and in sync")
            except BaseException as exc:  # raised in the harness's thread by run_window
                self._broker_error = exc

        self._broker_thread = threading.Thread(target=restart, name="broker-restart", daemon=True)
        self._broker_thread.start()

    def _sample(self) -> None:
        now = time.monotonic()
        rss = {}
        for role, pid in role_pids(self.launcher.pid).items():
            value = rss_bytes(pid)
            if value is not None:
                rss[role] = (pid, value)
        launcher = rss_bytes(self.launcher.pid)
        if launcher is not None:
            rss["launcher"] = (self.launcher.pid, launcher)
        for node in self.broker.nodes:
            pid = node.pid
            value = rss_bytes(pid) if pid else None
            if value is not None:
                rss[f"broker-{node.node_id}"] = (pid, value)
        self.memory.sample(now, rss)
        self._measure_live_heaps(final=False)
        try:
            from streamrft.launch.dashboard import group_lags

            for group, lag in group_lags(self._clients).items():
                self.soak.lags.setdefault(group, []).append(lag)
        except Exception as exc:  # a broker failing over: the next sample will do
            self.event(f"lags not sampled now: {exc}")

    def _measure_live_heaps(self, final: bool) -> None:
        """Each broker node's live heap once past warm-up and once at the end of the window (the same forced GC
        at both ends, so the two compare)."""
        for node in self.broker.nodes:
            life = self.memory.lives.get((f"broker-{node.node_id}", node.pid))
            if life is None or not life.samples or life.samples[-1][0] - life.first_seen < self.s.warmup_s:
                continue
            if len(life.live_heap) == 0 or (final and len(life.live_heap) == 1):
                value = jvm_live_heap(node.pid)
                if value is not None:
                    life.live_heap.append(value)
                    self.event(f"broker-{node.node_id}: {value / 2**20:.0f} MiB of heap live after a full GC")

    def event(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.began:7.1f}s]"
        self.soak.events.append(f"{stamp} {line}")
        console.print(f"[magenta]{stamp} {line}")

    # -- the end --------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """No more tasks: wait for the explorer to finish every produced step and the trainer to train them, then
        the clean stop (SIGINT, as Ctrl-C)."""
        began = time.monotonic()
        if self._broker_thread is not None:
            self._broker_thread.join()
        trained_before, stable_since = -1, time.monotonic()
        with console.status("catching up: the explorer finishes the produced steps, the trainer trains them…"):
            while time.monotonic() - began < CATCH_UP_S:
                self._check_launcher()
                if time.monotonic() - began > 30 and self._next_sample_due(began):
                    self._sample()
                trained = len(self._audit())
                if trained != trained_before:
                    trained_before, stable_since = trained, time.monotonic()
                explorer_done = self.soak.steps_done >= self.soak.produced_steps
                if explorer_done and time.monotonic() - stable_since > 20 and self._trainer_caught_up():
                    break
                time.sleep(1)
            else:
                self.soak.failure = (f"the run did not catch up within {CATCH_UP_S:.0f}s after the window "
                                     f"(explorer at step {self.soak.steps_done} of {self.soak.produced_steps})")
        self._sample()
        self._measure_live_heaps(final=True)
        self.soak.catch_up_s = time.monotonic() - began
        self.event("stopping the run with SIGINT")
        self.launcher.send_signal(signal.SIGINT)
        try:
            self.soak.launcher_exit = self.launcher.wait(120)
        except subprocess.TimeoutExpired:
            self.soak.failure = self.soak.failure or "streamrft run did not stop within 120 s of SIGINT"
        self.soak.finished = self.soak.failure is None

    def _next_sample_due(self, since: float) -> bool:
        return int((time.monotonic() - since) / SAMPLE_S) > int((time.monotonic() - since - 1) / SAMPLE_S)

    def _audit(self) -> list[dict]:
        from streamrft.consumers.trainer.checkpoints import Checkpoints

        return Checkpoints(self.out / "checkpoints", keep=1).audit()

    def _trainer_caught_up(self) -> bool:
        from streamrft.launch.dashboard import group_lags

        try:
            return group_lags(self._clients).get("trainer", 1) == 0
        except Exception:  # a broker not answering: ask again next time
            return False

    def restarts(self) -> dict[str, int]:
        try:
            return launcher_restarts(self.metrics_port)
        except OSError as exc:
            self.event(f"the launcher's metrics endpoint did not answer: {exc}")
            return {}

    def kill_everything(self) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
        for pid in role_pids(self.launcher.pid).values() if self.launcher is not None else ():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._clients is not None:
            self._clients.close()
        if self.broker is not None:
            self.broker.stop()


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------
def memory_table(memory: MemoryLedger, warmup_s: float) -> Table:
    table = Table(title=f"resident memory (each role's longest life; start = {warmup_s:.0f} s into it)")
    for column in ("process", "lives", "longest life (min)", "RSS start (MiB)", "RSS end (MiB)", "growth",
                   "JVM live heap start → end (MiB)"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for role in memory.roles():
        life = memory.longest(role)
        start, end = life.rss_after(warmup_s), life.rss_end()
        change = growth(start, end)
        shown = "-" if change is None else f"{change:+.1%}"
        if change is not None and abs(change) > 0.10:
            shown = f"[red]{shown}[/]"
        table.add_row(role, str(memory.lives_of(role)), f"{life.duration_s() / 60:.1f}",
                      "-" if start is None else f"{start / 2**20:.0f}", "-" if end is None else f"{end / 2**20:.0f}",
                      shown, _live_heap_cell(life))
    return table


def _live_heap_cell(life: Life) -> str:
    if len(life.live_heap) < 2:
        return "-"
    start, end = life.live_heap[0], life.live_heap[-1]
    return f"{start / 2**20:.0f} → {end / 2**20:.0f} ({growth(start, end):+.1%})"


def lag_table(lags: dict[str, list[int]]) -> Table:
    table = Table(title=f"consumer group lag (records, sampled every {SAMPLE_S:.0f} s)")
    for column in ("group", "median", "max", "last"):
        table.add_column(column, justify="left" if column == "group" else "right")
    for group, values in sorted(lags.items()):
        table.add_row(group, f"{statistics.median(values):g}", str(max(values)), str(values[-1]))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="the soak's window (60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=3, help="rollout workers (3)")
    parser.add_argument("--kill-every-s", type=float, default=180.0, help="mean seconds between role kills (180)")
    parser.add_argument("--broker-every-s", type=float, default=900.0,
                        help="mean seconds between broker node restarts (900)")
    parser.add_argument("--warmup-s", type=float, default=120.0,
                        help="a process's memory is read this long into its life, and at its end (120)")
    parser.add_argument("--out", type=Path, default=None, help="a new directory (default: runs/soak-<seed>)")
    args = parser.parse_args(argv)
    settings = SoakSettings(out=args.out or Path(f"runs/soak-{args.seed}"), minutes=args.minutes, seed=args.seed,
                            workers=args.workers, kill_every_s=args.kill_every_s,
                            broker_every_s=args.broker_every_s, warmup_s=args.warmup_s)
    run = SoakRun(settings)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    verdict = observed = None
    restarts: dict[str, int] = {}
    try:
        run.prepare()
        run.start_cluster()
        run.produce_steps(CHUNK_STEPS)
        run.start_run()
        try:
            run.run_window()
            run.finish()
        except RuntimeError as exc:
            run.soak.failure = str(exc)
        restarts = run.restarts() if run.launcher.poll() is None else _restarts_from_log(run.out / "launcher.log")
        observed = observe_topics(run.config(), run.bootstrap, run.out / "checkpoints")
        verdict = check(observed, run.soak.trainer_lifetimes, run.soak.produced_steps)
    finally:
        run.kill_everything()
    _check_contiguous(observed.audit, verdict)
    _check_restarts(run.soak.kills, restarts, verdict)
    if not run.soak.finished:
        verdict.fail("run finished", [run.soak.failure or "unknown"])
    wide = Console(width=max(Console().width, 120))
    wide.print(_summary_table(run, verdict, restarts))
    wide.print(memory_table(run.memory, settings.warmup_s))
    wide.print(lag_table(run.soak.lags))
    print_violations(verdict)
    (run.out / "soak.json").write_text(json.dumps(_summary(run, verdict, restarts), indent=1, default=str) + "\n")
    console.print(f"figures in {run.out / 'soak.json'}, logs in {run.run_dir / 'logs'}")
    return 0 if verdict.ok else 1


def _restarts_from_log(path: Path) -> dict[str, int]:
    """The launcher's last line "restarts: explorer 2, trainer 1" (its endpoint is gone once it stopped)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith("restarts: ")]
    if not lines:
        return {}
    return {name: int(n) for name, n in (part.rsplit(" ", 1) for part in lines[-1][len("restarts: "):].split(", "))}


def _check_contiguous(audit: list[dict], verdict) -> None:
    steps = [entry["step"] for entry in audit]
    if steps != list(range(steps[0], steps[0] + len(steps))) if steps else False:
        verdict.fail("trainer steps not contiguous", [str(steps)])
    verdict.figures["trainer steps"] = f"{steps[0]}..{steps[-1]}" if steps else "none"


def _check_restarts(kills: dict[str, int], restarts: dict[str, int], verdict) -> None:
    """Every kill is a restart on the launcher's own count, and nothing else was restarted (a role that died by
    itself would show as a restart without a kill)."""
    for role in sorted(set(kills) | set(restarts)):
        if kills.get(role, 0) != restarts.get(role, 0):
            verdict.fail("kills and restarts differ", [f"{role}: killed {kills.get(role, 0)}, restarted "
                                                       f"{restarts.get(role, 0)}"])


def _summary_table(run: SoakRun, verdict, restarts: dict[str, int]) -> Table:
    table = Table(title="soak", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    soak = run.soak
    rows = [("window (min)", f"{soak.window_s / 60:.1f}"), ("catch-up after it (s)", f"{soak.catch_up_s:.0f}"),
            ("steps produced / finished", f"{soak.produced_steps} / {soak.steps_done}"),
            ("role kills", ", ".join(f"{r} {n}" for r, n in sorted(soak.kills.items())) or "0"),
            ("restarts (launcher's metric)", ", ".join(f"{r} {n}" for r, n in sorted(restarts.items()) if n) or "0"),
            ("broker node restarts", soak.broker_restarts),
            ("launcher exit on SIGINT", soak.launcher_exit),
            ("finished", "yes" if soak.finished else f"no ({soak.failure})")]
    rows += list(verdict.figures.items())
    for name, value in rows:
        bad = name in ("duplicates", "lost") and value
        table.add_row(name, f"[red]{value}[/]" if bad else str(value))
    return table


def _summary(run: SoakRun, verdict, restarts: dict[str, int]) -> dict:
    memory = {}
    for role in run.memory.roles():
        life = run.memory.longest(role)
        start, end = life.rss_after(run.s.warmup_s), life.rss_end()
        memory[role] = {"lives": run.memory.lives_of(role), "longest_life_s": life.duration_s(),
                        "rss_start": start, "rss_end": end, "growth": growth(start, end),
                        "jvm_live_heap": life.live_heap or None}
    soak = run.soak
    return {"settings": {k: str(v) for k, v in vars(run.s).items()}, "kills": soak.kills, "restarts": restarts,
            "broker_restarts": soak.broker_restarts, "produced_steps": soak.produced_steps,
            "steps_done": soak.steps_done, "finished": soak.finished, "failure": soak.failure,
            "launcher_exit": soak.launcher_exit, "window_s": soak.window_s, "catch_up_s": soak.catch_up_s,
            "memory": memory, "lags": soak.lags, "events": soak.events, "figures": verdict.figures,
            "violations": verdict.violations}


if __name__ == "__main__":
    sys.exit(main())
