"""Chaos: a whole run (explorer, rollout workers, trainer as real `streamrft` processes on an embedded broker) while
a seeded schedule SIGKILLs them and restarts the broker, then a check of what the topics and the audit say.

Modelled on Kafka's own transactions system test. The run: ``--steps`` steps of ``batch_size`` tasks (total_epochs
1, so the explorer is done after the last task), the fake inference engine, a tiny random model trained on CPU,
``fixed`` pacing one step ahead. Every ``--kill-every-s`` (jittered) the schedule takes the next action from a
deck — each round a shuffled [a random worker, the explorer, the trainer], the broker once after the first round —
from the end of step 0 (every role is up) until ``--rounds`` are dealt, ``--duration-s`` has passed or the explorer
is within a few steps of the end (the tail runs undisturbed so the run can finish). A killed role is restarted after a short seeded delay; a worker comes back under its old
id (its transactional id fences the dead one's open transaction) or, by coin toss, a fresh one (the open
transaction then holds read_committed readers until ``rollout.transaction_timeout_ms``). A role that exits by
itself is a *crash*: recorded with its log tail and restarted (too many and the run is aborted).

The broker restart: SIGKILL of the JVM, a pause, a new JVM on the same data dir. `streamrft broker start` picks
free ports at every start, so through the CLI a restarted broker comes back on a new address and every role has
to be restarted with it. This harness pins the ports instead (``PinnedPortBroker``) so the roles ride the outage
on their reconnecting clients, which is the interesting case; if the old port cannot be bound again it falls back
to new ports and restarts every role with the new address (reported as ``broker same port: no``).

Invariants, checked at the end from read_committed reads of every topic and from the trainer's audit:

1. tasks: every produced task is in exactly one TRAIN RolloutRequest; the steps are 0..steps-1; no request twice;
2. results: every request has at most one RolloutResult (OK/FAILED/CANCELLED/TIMEOUT); one without a result must
   be counted CANCELLED/TIMEOUT in the explorer's metrics of its step; every step's metrics were published
   exactly once and their statuses add up to the step's tasks;
3. experiences: no eid twice; an OK result of n samples has exactly its n experiences (group_id = request_id);
   no experience without an OK result (no half-written or orphaned rollout);
4. training, across all trainer lifetimes. ``trained.jsonl`` holds the steps of the surviving lineage and a
   resumed trainer truncates it to its checkpoint, so the harness snapshots it whenever a trainer process ends
   (killed or crashed), with the newest complete checkpoint ``c`` the next one resumes from. Rule: each snapshot's
   entries with version <= c are *committed* and must appear unchanged in the final audit; entries with
   version > c were trained into weights that died with the process (*rolled back*) — their eids are trained
   again by the next lifetime, by design, and only counted. Then in the final audit no eid appears twice (trained
   or dropped-stale), and every eid in it is a visible experience (nothing trained from an aborted transaction);
5. accounting: every visible experience is trained or dropped-stale in the final audit, dead-lettered (on
   ``experiences.dlq``, with a reason), or covered by the surviving lineage's ``trainer/dropped_*`` metric counts
   (drops that name no eid); the rest is *lost*.

Prints kills, restarts, crashes, records by kind, duplicates and lost (both must be 0); exit code 1 when an
invariant fails, with the offending ids. Role logs: ``OUT/logs/<role>-<lifetime>.log``; figures: ``OUT/chaos.json``.

Usage: python bench/chaos.py [--seed 0] [--steps 30] [--workers 3] [--kill-every-s 8] [--duration-s S]
                             [--rounds N] [--out runs/chaos-<seed>]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from streamrft.broker import EmbeddedBroker
from streamrft.config import load_config
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import (Experience, Metric, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus,
                               SyncKind, SyncSignal, Task)

console = Console(stderr=True)

RUN_NAME = "chaos"
ROLES = ("worker", "explorer", "trainer")
STEP_DONE = re.compile(r"step (\d+) done")  # the explorer's log line at the end of each step
MAX_CRASHES_PER_ROLE = 8  # a role that dies by itself more often than this is crash-looping: abort the run
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class ChaosSettings:
    out: Path
    seed: int = 0
    steps: int = 30
    workers: int = 3
    kill_every_s: float = 8.0
    duration_s: float | None = None  # chaos window; None = until the explorer nears the end
    tail_steps: int = 3  # the last steps run without kills, so the run can finish
    rounds: int | None = None  # rounds of kills (one of each role per round); None = until the window ends
    broker_restarts: int = 1
    broker_down_s: float = 3.0
    batch_size: int = 4
    repeat_times: int = 2
    fake_latency_s: float = 0.1  # per sample: a worker batch takes ~0.4 s, so some kills land inside one
    save_interval: int = 2  # trainer checkpoints every N steps: a kill in between rolls steps back
    transaction_timeout_ms: int = 10_000
    timeout_s: float = 1200.0  # the whole run, chaos included
    stall_s: float = 180.0  # no explorer step finished for this long: dump every role's stacks and give up


# ---------------------------------------------------------------------------------------------------------------
# the broker and the role processes
# ---------------------------------------------------------------------------------------------------------------
class PinnedPortBroker(EmbeddedBroker):
    """The embedded broker, restartable on the address it had. EmbeddedBroker picks two free ports at every
    start; given ``ports`` (client, controller) this one writes those instead, so clients that keep reconnecting
    to the old address find the restarted broker. A port that cannot be bound makes start() fail."""

    def __init__(self, *args, ports: tuple[int, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pinned = ports
        self.ports: tuple[int, int] | None = None

    def _write_config(self, port: int, controller_port: int) -> None:
        self.ports = self.pinned or (port, controller_port)
        super()._write_config(*self.ports)


@dataclass
class Crash:
    role: str
    lifetime: int
    exit_code: int | None
    log: str
    tail: str


class RoleProcess:
    """One role slot (``explorer``, ``trainer``, ``w0``...): a `streamrft` CLI process in a session of its own,
    started again after each death. Lifetimes are numbered from 1; each has its own log file."""

    def __init__(self, name: str, kind: str, argv: list[str], logs: Path, cwd: Path):
        self.name, self.kind, self.argv = name, kind, argv
        self.logs, self.cwd = logs, cwd
        self.proc: subprocess.Popen | None = None
        self.lifetime = 0
        self.finished = False  # exited 0 at the end of the run (explorer done, trainer drained)
        self.restart_at: float | None = None
        self.exited_at: float | None = None  # when the harness first saw this lifetime dead

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}-{self.lifetime}.log"

    def start(self, env: dict[str, str], argv: list[str] | None = None) -> None:
        self.argv = argv or self.argv
        self.lifetime += 1
        self.restart_at = self.exited_at = None
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.cwd, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the process group (the role and anything it spawned) and reap it."""
        if self.proc is None:
            return
        _killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # uninterruptible sleep; it goes when the kernel lets it
            console.print(f"[yellow]{self.name} (pid {self.proc.pid}) did not die within 10 s of SIGKILL")

    def terminate(self, timeout: float = STOP_GRACE_S) -> bool:
        """Graceful stop (SIGTERM: the role finishes its unit of work); a role still running after ``timeout``
        s is hung: its stacks go to its log, then it is killed. Returns whether it stopped by itself."""
        if not self.alive():
            return True
        _killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            console.print(f"[yellow]{self.name} did not stop within {timeout:.0f} s of SIGTERM; its stacks are in "
                          f"{self.log_path}")
            self.dump_stacks()
            return False

    def dump_stacks(self) -> None:
        """SIGABRT: Python's faulthandler (PYTHONFAULTHANDLER=1) writes every thread's stack to the log, even
        from inside a blocking C call; then the process group is killed."""
        if not self.alive():
            return
        os.kill(self.proc.pid, signal.SIGABRT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# the schedule
# ---------------------------------------------------------------------------------------------------------------
class Schedule:
    """Seeded chaos actions: rounds of a shuffled [worker, explorer, trainer], the broker after the first round;
    None once ``rounds`` rounds (None: no limit) and the broker restarts are spent."""

    def __init__(self, rng: random.Random, broker_restarts: int, rounds: int | None):
        self.rng = rng
        self.broker_left = broker_restarts
        self.rounds_left = rounds
        self.deck: list[str] = []
        self.dealt = 0

    def next_action(self) -> str | None:
        if not self.deck:
            if self.dealt >= 1 and self.broker_left:
                self.broker_left -= 1
                return "broker"
            if self.rounds_left is not None:
                if self.rounds_left == 0:
                    return None
                self.rounds_left -= 1
            self.dealt += 1
            self.deck = self.rng.sample(ROLES, len(ROLES))
        return self.deck.pop()

    def next_delay(self, every_s: float) -> float:
        return every_s * self.rng.uniform(0.5, 1.5)


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TrainerLifetime:
    """What one trainer process left behind when it ended: its audit and the checkpoint its successor resumes."""

    lifetime: int
    how: str  # "killed" | "crashed"
    audit: list[dict]
    checkpoint_step: int  # newest complete checkpoint (-1: none)


@dataclass
class Chaos:
    """What the harness did, for the report."""

    kills: Counter = field(default_factory=Counter)
    restarts: Counter = field(default_factory=Counter)  # restarts after a kill or crash, by role kind
    crashes: list[Crash] = field(default_factory=list)
    broker_restarts: int = 0
    broker_same_port: bool | None = None
    fresh_worker_ids: int = 0
    trainer_lifetimes: list[TrainerLifetime] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # "t=12.3s step 4: SIGKILL w1#2", for the summary
    stacks: list[str] = field(default_factory=list)  # logs holding the stacks of hung roles
    steps_done: int = 0
    finished: bool = False
    aborted: str | None = None
    wall_s: float = 0.0


class ChaosRun:
    def __init__(self, settings: ChaosSettings):
        self.s = settings
        self.out = Path(settings.out).resolve()
        self.rng = random.Random(settings.seed)
        self.schedule = Schedule(random.Random(settings.seed + 1), settings.broker_restarts, settings.rounds)
        self.chaos = Chaos()
        self.began = time.monotonic()
        self.broker: PinnedPortBroker | None = None
        self.roles: dict[str, RoleProcess] = {}
        self.config_path = self.out / "run.yaml"
        self.logs = self.out / "logs"
        self._worker_serial = 0

    # -- set-up -------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        if self.out.exists() and any(self.out.iterdir()):
            raise SystemExit(f"{self.out} is not empty; give --out a new directory (the broker's data lives there)")
        self.logs.mkdir(parents=True, exist_ok=True)
        from streamrft.engines.models import build_tiny_model

        with console.status("building the tiny model…"):
            build_tiny_model(self.out / "model", seed=self.s.seed)
        rows = [{"question": f"What is {i % 9} + {i % 7}?", "answer": i % 9 + i % 7}
                for i in range(self.s.steps * self.s.batch_size)]
        (self.out / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.config_path.write_text(yaml.safe_dump(self._run_config()))

    def _run_config(self) -> dict:
        s = self.s
        return {
            "name": RUN_NAME,
            "model": {"path": str(self.out / "model")},
            "sync": {"style": "fixed", "interval": 1, "offset": 1, "max_staleness": 2},
            "explorer": {"batch_size": s.batch_size, "repeat_times": s.repeat_times, "total_epochs": 1,
                         "max_steps": s.steps, "step_timeout_s": 300, "metrics_port": None},
            "rollout": {"engine": "fake", "fake_latency_s": s.fake_latency_s, "requests_per_batch": 2,
                        "transaction_timeout_ms": s.transaction_timeout_ms, "sampling": {"max_tokens": 6},
                        "metrics_port": None},
            "trainer": {"lr": 1e-3, "micro_batch_size": 8, "save_interval": s.save_interval, "device": "cpu",
                        "checkpoint_dir": str(self.out / "checkpoints"), "metrics_port": None},
            "monitor": {"output_dir": str(self.out / "run"), "metrics_port": None, "tensorboard": False},
            # more rollout partitions than workers, so a rebalance after a kill moves several
            "topics": {"rollouts": {"partitions": 2 * s.workers}, "experiences": {"partitions": 2}},
        }

    def config(self):
        return load_config(self.config_path, env={}, overrides={"kafka": {"bootstrap_servers": self.bootstrap}})

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRFT_")}
        # one thread each: the roles share a small machine; PASSIVE as `streamrft run` does
        env.update({"STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap, "STREAMRFT_LOG_LEVEL": "INFO",
                    "COLUMNS": "200", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"})
        return env

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "streamrft.cli", *args]

    def start_broker(self, ports: tuple[int, int] | None = None) -> None:
        self.broker = PinnedPortBroker(load_config(self.config_path, env={}).broker, data_dir=self.out / "kafka",
                                       keep_data=True, ports=ports)
        with console.status("starting the broker…"):
            self.broker.start()
        console.print(f"broker at {self.broker.bootstrap_servers} (data {self.broker.data_dir})")

    def run_cli(self, what: str, *args: str, timeout: float = 180) -> None:
        with console.status(f"{what}…"):
            result = subprocess.run(self._cli(*args), env=self._env(), cwd=self.out, capture_output=True,
                                    text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"`streamrft {' '.join(args)}` failed ({result.returncode}):\n"
                               f"{(result.stdout + result.stderr)[-3000:]}")

    def start_roles(self) -> None:
        cfg = str(self.config_path)
        self.roles["trainer"] = RoleProcess("trainer", "trainer", self._cli("train", cfg), self.logs, self.out)
        for i in range(self.s.workers):
            name = f"w{i}"
            self.roles[name] = RoleProcess(name, "worker", self._worker_argv(name), self.logs, self.out)
        self.roles["explorer"] = RoleProcess("explorer", "explorer", self._cli("explorer", cfg), self.logs, self.out)
        for role in self.roles.values():
            role.start(self._env())

    def _worker_argv(self, worker_id: str) -> list[str]:
        return self._cli("rollout", str(self.config_path), "--worker-id", worker_id)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> None:
        began = self.began = time.monotonic()
        deadline = began + self.s.timeout_s
        chaos_began, next_action = None, 0.0  # the chaos starts once step 0 is done: every role is up by then
        progressed = began  # when the explorer last finished a step
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[figures]}"), TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("steps", total=self.s.steps, figures="")
            while not self._done():
                now = time.monotonic()
                if now > deadline:
                    self.chaos.aborted = f"the run did not finish within --timeout-s {self.s.timeout_s:.0f}"
                    break
                self._supervise()
                done = self._steps_done()
                if done != self.chaos.steps_done:
                    self.chaos.steps_done, progressed = done, now
                if now - progressed > self.s.stall_s:
                    self._stalled(now - progressed)
                    break
                if chaos_began is None and self.chaos.steps_done >= 1:
                    chaos_began, next_action = now, now + self.schedule.next_delay(self.s.kill_every_s)
                in_window = (chaos_began is not None and self.chaos.steps_done < self.s.steps - self.s.tail_steps
                             and (self.s.duration_s is None or now < chaos_began + self.s.duration_s))
                if in_window and now >= next_action:
                    action = self.schedule.next_action()
                    if action is None:  # the schedule is spent: the rest of the run is calm
                        next_action = float("inf")
                    else:
                        self._act(action)
                    next_action = time.monotonic() + self.schedule.next_delay(self.s.kill_every_s)
                progress.update(bar, completed=self.chaos.steps_done, figures=self._figures_line(in_window))
                time.sleep(0.25)
            progress.update(bar, completed=self._steps_done(), figures=self._figures_line(False))
        self.chaos.finished = self._done()
        self.chaos.wall_s = time.monotonic() - began

    def _stalled(self, idle_s: float) -> None:
        """No step for ``stall_s``: record where every live role is stuck (its stacks, in its log) and stop."""
        self.chaos.aborted = f"stalled: no step finished for {idle_s:.0f} s after step {self.chaos.steps_done - 1}"
        self._event(self.chaos.aborted + "; stacks of the live roles in their logs")
        for role in self.roles.values():
            if role.alive():
                self.chaos.stacks.append(str(role.log_path))
                role.dump_stacks()

    def _done(self) -> bool:
        return self.roles["explorer"].finished and self.roles["trainer"].finished

    def _figures_line(self, in_window: bool) -> str:
        kills = " ".join(f"{k}×{self.chaos.kills[k]}" for k in (*ROLES, "broker") if self.chaos.kills[k])
        return f"kills: {kills or '-'}  crashes: {len(self.chaos.crashes)}  {'chaos' if in_window else 'calm'}"

    def _steps_done(self) -> int:
        """Steps the explorer finished, from its logs (every lifetime's)."""
        best = -1
        for path in self.logs.glob("explorer-*.log"):
            for match in STEP_DONE.finditer(path.read_text(errors="replace")):
                best = max(best, int(match.group(1)))
        return best + 1

    def _supervise(self) -> None:
        """Restart what is due; record a role that died by itself as a crash and schedule its restart."""
        now = time.monotonic()
        # the explorer first: the trainer's exit 0 is only an end once the explorer has ended
        for role in sorted(self.roles.values(), key=lambda r: r.kind != "explorer"):
            if role.restart_at is not None:
                if now >= role.restart_at:
                    self._restart(role)
                continue
            if role.finished or role.proc is None or role.alive():
                continue
            role.exited_at = role.exited_at or now
            if role.returncode == 0:
                verdict = self._end_of(role, now)
                if verdict == "finished":
                    role.finished = True
                    console.print(f"{role.name} finished (lifetime {role.lifetime})")
                if verdict != "crashed":
                    continue
            crash = Crash(role.name, role.lifetime, role.returncode, str(role.log_path), role.log_tail(12))
            self.chaos.crashes.append(crash)
            self._event(f"{role.name}#{role.lifetime} exited by itself (code {crash.exit_code})")
            console.print(f"[red]{role.name} exited by itself (code {crash.exit_code}, lifetime {role.lifetime});"
                          f" log {crash.log}:[/]\n{crash.tail}")
            if sum(c.role == role.name for c in self.chaos.crashes) > MAX_CRASHES_PER_ROLE:
                raise ChaosAbort(f"{role.name} is crash-looping ({MAX_CRASHES_PER_ROLE}+ exits); see {crash.log}")
            if role.kind == "trainer":
                self._snapshot_trainer(role, "crashed")
            role.restart_at = now + 2.0

    def _end_of(self, role: RoleProcess, now: float) -> str:
        """What an exit 0 means: the explorer ends when the run is done; the trainer once the explorer has
        (it may see the explorer's "done" a moment before that process exits, hence the grace); anything else
        exiting is a crash."""
        if role.kind == "explorer":
            return "finished"
        if role.kind == "trainer":
            if self.roles["explorer"].finished:
                return "finished"
            if now - role.exited_at < 30:
                return "undecided"
        return "crashed"

    def _restart(self, role: RoleProcess) -> None:
        argv = None
        if role.kind == "worker" and self.rng.random() < 0.5:  # come back as a new member, not the old id
            self._worker_serial += 1
            argv = self._worker_argv(f"{role.name}-r{self._worker_serial}")
            self.chaos.fresh_worker_ids += 1
        role.start(self._env(), argv)
        self.chaos.restarts[role.kind] += 1

    def _act(self, action: str) -> None:
        if action == "broker":
            self._restart_broker()
            return
        if action == "worker":
            candidates = [r for r in self.roles.values() if r.kind == "worker" and r.alive()]
        else:
            candidates = [r for r in self.roles.values() if r.kind == action and r.alive() and not r.finished]
        if not candidates:  # already down, waiting for its restart: deal this action again next time
            self.schedule.deck.append(action)
            return
        role = self.rng.choice(candidates)
        role.kill()
        self.chaos.kills[action] += 1
        self._event(f"SIGKILL {role.name}#{role.lifetime}")
        if role.kind == "trainer":
            self._snapshot_trainer(role, "killed")
        role.restart_at = time.monotonic() + self.rng.uniform(0.5, 3.0)

    def _event(self, what: str) -> None:
        line = f"t={time.monotonic() - self.began:.1f}s step {self.chaos.steps_done}: {what}"
        self.chaos.events.append(line)
        console.print(f"[magenta]{line}")

    def _snapshot_trainer(self, role: RoleProcess, how: str) -> None:
        """Before the next trainer truncates the audit to its checkpoint: keep what this lifetime left."""
        from streamrft.consumers.checkpoints import Checkpoints

        checkpoints = Checkpoints(self.out / "checkpoints", keep=1)
        steps = checkpoints.steps()
        self.chaos.trainer_lifetimes.append(TrainerLifetime(role.lifetime, how, checkpoints.audit(),
                                                            steps[-1] if steps else -1))
        if checkpoints.audit_path.exists():
            shutil.copy(checkpoints.audit_path, self.logs / f"trained-lifetime-{role.lifetime}.jsonl")

    def _restart_broker(self) -> None:
        ports = self.broker.ports
        self._event(f"SIGKILL broker (pid {self.broker.pid})")
        _killpg(self.broker.pid, signal.SIGKILL)
        self.broker.stop(timeout=0)  # reaps the dead JVM and its watchdog; keep_data: the data stays
        self.chaos.kills["broker"] += 1
        time.sleep(self.s.broker_down_s)
        try:
            self.start_broker(ports)
            self.chaos.broker_same_port = True
            self._event(f"broker back on {self.bootstrap}")
        except Exception as exc:  # the old port was taken meanwhile: new address, so every role must restart
            console.print(f"[yellow]broker could not come back on {ports}: {exc}; new ports, restarting all roles")
            self.broker.stop(timeout=0)
            self.start_broker()
            self.chaos.broker_same_port = False
            for role in self.roles.values():
                if not role.finished:
                    role.kill()
                    if role.kind == "trainer":
                        self._snapshot_trainer(role, "killed")
                    role.restart_at = time.monotonic()
        self.chaos.broker_restarts += 1

    def stop_workers(self) -> None:
        with console.status("stopping the workers…"):
            for role in self.roles.values():
                if role.kind == "worker" and not role.terminate():
                    self.chaos.stacks.append(str(role.log_path))
                    self._event(f"{role.name}#{role.lifetime} hung at stop (stacks in its log)")

    def kill_everything(self) -> None:
        for role in self.roles.values():
            if role.alive():
                role.kill()
        if self.broker is not None:
            self.broker.stop()


class ChaosAbort(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# what the topics say
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Observed:
    """Every topic of the run as a read_committed reader sees it, plus the final audit."""

    tasks: list[Task]
    requests: list[RolloutRequest]
    results: list[RolloutResult]
    experiences: list[Experience]
    metrics: list[Metric]
    sync: list[SyncSignal]
    dead_letters: dict[str, int]  # records per <topic>.dlq
    dead_lettered_eids: set[str]  # experiences a role refused (on experiences.dlq with a reason): dropped
    audit: list[dict]


def observe(run: ChaosRun) -> Observed:
    config = run.config()
    clients = KafkaClients(config, run.bootstrap)

    def read(name: str, record_type):
        topic = config.topic(name)
        return [clients.serde.decode(r.value, topic, record_type)
                for r in read_to_end(config.kafka, run.bootstrap, topic, timeout=120)]

    with console.status("reading every topic (read_committed)…"):
        topics = clients.admin().list_topics(timeout=10).topics
        letters = {name: read_to_end(config.kafka, run.bootstrap, name, timeout=120)
                   for name in sorted(topics) if name.startswith(config.topic_prefix) and name.endswith(".dlq")}
        refused = {_eid_of(clients, config, r.value) for r in letters.get(config.topic("experiences") + ".dlq", [])}
        observed = Observed(read("tasks", Task), read("rollouts", RolloutRequest), read("results", RolloutResult),
                            read("experiences", Experience), read("metrics", Metric), read("sync", SyncSignal),
                            {name: len(records) for name, records in letters.items()}, refused - {None}, [])
    from streamrft.consumers.checkpoints import Checkpoints

    observed.audit = Checkpoints(run.out / "checkpoints", keep=1).audit()
    return observed


def _eid_of(clients: KafkaClients, config, value: bytes | None) -> str | None:
    """The eid of a dead-lettered experience (the DLQ keeps the original bytes), if it still decodes."""
    try:
        return clients.serde.decode(value, config.topic("experiences"), Experience).eid
    except Exception:  # undecodable is why some records are dead letters; they have no eid to account
        return None


# ---------------------------------------------------------------------------------------------------------------
# the invariants (pure: records in, figures and violations out)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    figures: dict[str, object] = field(default_factory=dict)
    violations: dict[str, list[str]] = field(default_factory=dict)

    def fail(self, invariant: str, ids) -> None:
        ids = sorted(str(i) for i in ids)
        if ids:
            self.violations.setdefault(invariant, []).extend(ids)

    @property
    def ok(self) -> bool:
        return not self.violations


def _last_per_step(metrics: list[Metric], role: str) -> dict[int, dict[str, float]]:
    """The newest value of each metric per step for ``role`` (topic order: a step re-trained after a rollback
    overrides the lost lineage's record)."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for m in metrics:
        if m.role == role:
            out[m.step][m.name] = m.value
    return out


def check(observed: Observed, lifetimes: list[TrainerLifetime], steps: int) -> Verdict:
    v = Verdict()
    _check_tasks(observed, steps, v)
    train_requests = {r.request_id: r for r in observed.requests if r.kind == RolloutKind.TRAIN}
    ok_results = _check_results(observed, train_requests, v)
    visible = _check_experiences(observed, ok_results, v)
    _check_training(observed, lifetimes, visible, v)
    v.figures["dead letters"] = sum(observed.dead_letters.values())
    v.figures["duplicates"] = sum(len(v.violations.get(k, [])) for k in (
        "task rolled out twice", "request published twice", "request with several results",
        "eid twice on experiences", "eid twice in the final audit", "step finished more than once"))
    v.figures["lost"] = sum(len(v.violations.get(k, [])) for k in (
        "task never rolled out", "request without result or count", "OK result missing experiences",
        "experience neither trained nor counted as dropped", "committed audit entry lost", "step never finished"))
    return v


def _check_tasks(o: Observed, steps: int, v: Verdict) -> None:
    produced = Counter(t.task_id for t in o.tasks)
    train = [r for r in o.requests if r.kind == RolloutKind.TRAIN]
    per_task = Counter(r.task.task_id for r in train)
    v.fail("task produced twice", [t for t, n in produced.items() if n > 1])
    v.fail("task never rolled out", [t for t in produced if t not in per_task])
    v.fail("task rolled out twice", [t for t, n in per_task.items() if n > 1])
    v.fail("request for an unknown task", [t for t in per_task if t not in produced])
    v.fail("request published twice", [r for r, n in Counter(r.request_id for r in train).items() if n > 1])
    v.fail("step out of range", {r.step for r in train if not 0 <= r.step < steps})
    v.figures.update({"steps": len({r.step for r in train}), "tasks": len(produced), "requests": len(train)})


def _check_results(o: Observed, requests: dict[str, RolloutRequest], v: Verdict) -> dict[str, RolloutResult]:
    results = defaultdict(list)
    for r in o.results:
        if r.kind == RolloutKind.TRAIN:
            results[r.request_id].append(r)
    v.fail("request with several results", [rid for rid, rs in results.items() if len(rs) > 1])
    v.fail("result for an unknown request", [rid for rid in results if rid not in requests])
    statuses = Counter(rs[-1].status.value for rs in results.values())
    v.figures.update({f"results {s.value}": statuses[s.value] for s in RolloutStatus})
    # the explorer's own account of each step: rollout/* metrics, published once with the step's state
    finishes = Counter(m.step for m in o.metrics if m.role == "explorer" and m.name == "rollout/tasks")
    explorer = _last_per_step(o.metrics, "explorer")
    by_step = defaultdict(list)
    for rid, request in requests.items():
        by_step[request.step].append(rid)
    declared = 0
    for step, rids in sorted(by_step.items()):
        m = explorer.get(step, {})
        if "rollout/tasks" not in m:
            v.fail("step never finished", [f"step {step}"])
            continue
        counted = sum(m.get(f"rollout/{k}", 0) for k in ("ok", "failed", "cancelled", "timeout"))
        if int(m["rollout/tasks"]) != len(rids) or int(counted) != len(rids):
            v.fail("step metrics do not add up", [f"step {step}: tasks {m['rollout/tasks']:g}, statuses "
                                                   f"{counted:g}, requests {len(rids)}"])
        missing = [rid for rid in rids if rid not in results]
        room = int(m.get("rollout/cancelled", 0) + m.get("rollout/timeout", 0))
        declared += len(missing)
        if len(missing) > room:
            v.fail("request without result or count", missing)
    v.fail("step finished more than once", [f"step {s}" for s, n in finishes.items() if n > 1])
    v.figures["declared cancelled/timeout (no result)"] = declared
    return {rid: rs[-1] for rid, rs in results.items() if rs[-1].status == RolloutStatus.OK}


def _check_experiences(o: Observed, ok_results: dict[str, RolloutResult], v: Verdict) -> set[str]:
    train = [e for e in o.experiences if e.kind == RolloutKind.TRAIN]
    eids = Counter(e.eid for e in train)
    v.fail("eid twice on experiences", [eid for eid, n in eids.items() if n > 1])
    per_group = defaultdict(set)
    for e in train:
        per_group[e.group_id].add(e.eid)
    v.fail("OK result missing experiences", [f"{rid}: {len(per_group.get(rid, ()))} of {r.n}"
                                             for rid, r in ok_results.items() if len(per_group.get(rid, ())) != r.n])
    v.fail("experience without an OK result", [eid for gid, group in per_group.items() if gid not in ok_results
                                               for eid in group])
    v.figures["experiences"] = len(eids)
    return set(eids)


def _check_training(o: Observed, lifetimes: list[TrainerLifetime], visible: set[str], v: Verdict) -> None:
    final = {entry["version"]: entry for entry in o.audit}
    trained = Counter(eid for entry in o.audit for eid in entry["eids"])
    stale = Counter(eid for entry in o.audit for eid in entry.get("dropped_stale", []))
    v.fail("eid twice in the final audit", [eid for eid, n in (trained + stale).items() if n > 1])
    v.fail("trained eid not visible to read_committed", [eid for eid in trained + stale if eid not in visible])
    rolled_back: set[str] = set()
    for life in lifetimes:
        for entry in life.audit:
            if entry["version"] > life.checkpoint_step:
                rolled_back.update(entry["eids"])
            elif final.get(entry["version"]) != entry:  # committed history must survive unchanged
                v.fail("committed audit entry lost", [f"lifetime {life.lifetime} v{entry['version']}"])
    # drops the trainer only counted (no eid in the audit): the surviving lineage's trainer/dropped_* metrics
    trainer = _last_per_step(o.metrics, "trainer")
    lineage_steps = {entry["step"] for entry in o.audit}
    counted = sum(trainer.get(s, {}).get("trainer/dropped_stale", 0) + trainer.get(s, {}).get(
        "trainer/dropped_incomplete", 0) for s in lineage_steps)
    uncounted = int(counted) - len(stale)
    residual = sorted(visible - set(trained) - set(stale) - o.dead_lettered_eids)
    if len(residual) > max(uncounted, 0):
        v.fail("experience neither trained nor counted as dropped", residual)
    v.figures.update({
        "trained": len(trained), "dropped stale (audit)": len(stale),
        "dropped, dead-lettered": len(o.dead_lettered_eids & visible),
        "dropped, counted only": max(uncounted, 0), "trainer steps (final lineage)": len(o.audit),
        "re-trained after a rollback": len(rolled_back & set(trained)),
        "rolled-back trainer steps": sum(1 for life in lifetimes for e in life.audit
                                         if e["version"] > life.checkpoint_step),
    })


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------
def report(chaos: Chaos, verdict: Verdict, observed: Observed | None) -> Table:
    table = Table(title="chaos run", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [(f"kills {k}", chaos.kills[k]) for k in ROLES]
    rows += [(f"restarts {k}", chaos.restarts[k]) for k in ROLES]
    rows += [("workers back under a fresh id", chaos.fresh_worker_ids),
             ("crashes (exited by themselves)", len(chaos.crashes)),
             ("hung roles (stacks in their logs)", len(chaos.stacks)),
             ("broker restarts", chaos.broker_restarts),
             ("broker same port", {None: "-", True: "yes", False: "no"}[chaos.broker_same_port]),
             ("trainer lifetimes", len(chaos.trainer_lifetimes) + 1),
             ("finished", "yes" if chaos.finished else f"no ({chaos.aborted})"),
             ("wall clock (s)", f"{chaos.wall_s:.0f}")]
    if observed is not None:
        versions = [s.version for s in observed.sync if s.kind == SyncKind.WEIGHTS_PUBLISHED]
        rows.append(("weights versions published", f"{len(versions)} (max v{max(versions, default=0)})"))
    rows += list(verdict.figures.items())
    for name, value in rows:
        bad = name in ("duplicates", "lost") and value
        table.add_row(name, f"[red]{value}[/]" if bad else str(value))
    return table


def print_crashes(chaos: Chaos) -> None:
    """Roles that exited by themselves: the last line of their log says why."""
    for crash in chaos.crashes:
        last = next((line.strip() for line in reversed(crash.tail.splitlines()) if line.strip()), "")
        console.print(f"[yellow]CRASH[/] {crash.role}#{crash.lifetime} exit {crash.exit_code}: {last} ({crash.log})")


def print_violations(verdict: Verdict) -> None:
    for invariant, ids in verdict.violations.items():
        shown = ", ".join(ids[:20]) + (f" … and {len(ids) - 20} more" if len(ids) > 20 else "")
        console.print(f"[red]VIOLATION[/] {invariant} ({len(ids)}): {shown}")


def write_summary(out: Path, chaos: Chaos, verdict: Verdict) -> None:
    # asdict() would rebuild each Counter from (key, value) pairs, counting the pairs: give it plain dicts
    summary = {"chaos": {**asdict(chaos), "kills": dict(chaos.kills), "restarts": dict(chaos.restarts),
                         "trainer_lifetimes": [
        {"lifetime": t.lifetime, "how": t.how, "audit_steps": len(t.audit), "checkpoint_step": t.checkpoint_step}
        for t in chaos.trainer_lifetimes]}, "figures": verdict.figures, "violations": verdict.violations}
    (out / "chaos.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    chaos: Chaos
    verdict: Verdict
    observed: Observed | None


def run_chaos(settings: ChaosSettings) -> Outcome:
    """The whole experiment: set up, run under chaos, check. Every child is killed on the way out."""
    run = ChaosRun(settings)
    atexit.register(run.kill_everything)  # also on an exception that escapes the finally's caller
    observed = None
    try:
        run.prepare()
        run.start_broker()
        run.run_cli("creating topics", "topics", "-c", str(run.config_path), "--create")
        run.run_cli("producing tasks", "tasks", "produce", str(run.out / "tasks.jsonl"), "-c", str(run.config_path))
        run.start_roles()
        try:
            run.run()
        except ChaosAbort as exc:
            run.chaos.aborted = str(exc)
        run.stop_workers()
        observed = observe(run)
        verdict = check(observed, run.chaos.trainer_lifetimes, settings.steps)
    finally:
        run.kill_everything()
        atexit.unregister(run.kill_everything)
    if not run.chaos.finished:
        verdict.fail("run finished", [run.chaos.aborted or "unknown"])
    write_summary(run.out, run.chaos, verdict)
    return Outcome(run.chaos, verdict, observed)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # unwinds through run_chaos's finally, which kills every child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedule, delays and victims (0)")
    parser.add_argument("--steps", type=int, default=30, help="explorer steps of the run (30)")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="chaos window in seconds (default: until the explorer is 3 steps from the end)")
    parser.add_argument("--workers", type=int, default=3, help="rollout worker processes (3)")
    parser.add_argument("--kill-every-s", type=float, default=8.0, help="mean seconds between actions (8)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of kills, one of each role per round (default: until the window ends)")
    parser.add_argument("--broker-restarts", type=int, default=1, help="broker restarts during the window (1)")
    parser.add_argument("--batch-size", type=int, default=4, help="tasks per step (4)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="give up on the run after this (1200)")
    parser.add_argument("--out", type=Path, default=None, help="a new directory (default: runs/chaos-<seed>)")
    args = parser.parse_args(argv)
    settings = ChaosSettings(out=args.out or Path(f"runs/chaos-{args.seed}"), seed=args.seed, steps=args.steps,
                             workers=args.workers, kill_every_s=args.kill_every_s, duration_s=args.duration_s,
                             rounds=args.rounds, broker_restarts=args.broker_restarts, batch_size=args.batch_size,
                             timeout_s=args.timeout_s)
    signal.signal(signal.SIGTERM, _interrupt)
    outcome = run_chaos(settings)
    Console().print(report(outcome.chaos, outcome.verdict, outcome.observed))
    print_crashes(outcome.chaos)
    for log in outcome.chaos.stacks:
        console.print(f"[yellow]HUNG[/] stacks in {log}")
    print_violations(outcome.verdict)
    console.print(f"logs in {settings.out / 'logs'}, figures in {settings.out / 'chaos.json'}")
    return 0 if outcome.verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
