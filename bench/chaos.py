"""Chaos: a whole run (explorer, rollout workers, trainer as real `streamrft` processes on an embedded broker, or
with ``--nodes 3`` on a replicated 3-node cluster) while a seeded schedule SIGKILLs them and the brokers, then a
check of what the topics and the audit say.

Modelled on Kafka's own transactions system test. The run: ``--steps`` steps of ``batch_size`` tasks (total_epochs
1, so the explorer is done after the last task), the fake inference engine, a tiny random model trained on CPU,
``fixed`` pacing one step ahead. Every ``--kill-every-s`` (jittered) the schedule takes the next action from a
deck — each round a shuffled [a random worker, the explorer, the trainer], the broker once after the first round —
from the end of step 0 (every role is up) until ``--rounds`` are dealt, ``--duration-s`` has passed or the explorer
is within a few steps of the end (the tail runs undisturbed so the run can finish). A killed role is restarted after a short seeded delay; a worker comes back under its old
id (its transactional id fences the dead one's open transaction) or, by coin toss, a fresh one (the open
transaction then holds read_committed readers until ``rollout.transaction_timeout_ms``). A role that exits by
itself is a *crash*: recorded with its log tail and restarted (too many and the run is aborted).

The broker restart (one node): SIGKILL of the JVM, a pause, a new JVM on the same data dir and the same ports
(``EmbeddedBroker.start_node``), so the roles ride the outage on their reconnecting clients, which is the
interesting case; if the old port cannot be bound again it falls back to new ports and restarts every role with
the new address (reported as ``broker same port: no``).

On a cluster (``--nodes 3``, every topic replicated 3 times, min.insync.replicas 2) the broker actions are, one per
round and one at a time (the next waits until every replica is back in sync, so the quorum and two in-sync
replicas are always kept): SIGKILL of a random node, which comes back with an empty disk; of the active KRaft
controller; of the leader of ``experiences``' busiest partition; of the transaction coordinator of a live worker;
and a rolling restart of all three (SIGTERM, each node back in sync before the next, the controller last). A
killed node is down ``--broker-down-s``. For each action the report gives the time until the cluster was whole
again and what it cost the loop: the longest gap between results becoming visible to a read_committed reader
(the explorer's view) from the action until MEASURE_TAIL_S after the cluster healed, beside the run's median gap.
So that this cost is the action's own, a broker action begins only on a settled loop (no role restarted in the
last SETTLE_S) and no role is killed while it is measured.

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
                             [--rounds N] [--nodes 3] [--out runs/chaos-<seed>]
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
import statistics
import subprocess
import sys
import threading
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
from streamrft.errors import BrokerError
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_to_end
from streamrft.schemas import (Experience, Metric, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus,
                               SyncKind, SyncSignal, Task)

console = Console(stderr=True)

RUN_NAME = "chaos"
ROLES = ("worker", "explorer", "trainer")
# what a round does to the brokers: one node restarted; on a cluster each of these once (see the docstring)
SINGLE_NODE_ACTIONS = ("broker",)
CLUSTER_ACTIONS = ("random-empty-disk", "controller", "experiences-leader", "coordinator", "rolling-restart")
STEP_DONE = re.compile(r"step (\d+) done")  # the explorer's log line at the end of each step
MAX_CRASHES_PER_ROLE = 8  # a role that dies by itself more often than this is crash-looping: abort the run
STOP_GRACE_S = 20.0
# on a cluster, a broker action begins only when no role was (re)started for this long, and no role is killed until
# MEASURE_TAIL_S after the cluster healed: what each broker action cost the loop is then its own
SETTLE_S = 10.0
MEASURE_TAIL_S = 5.0


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
    broker_restarts: int = 1  # one node: restarts of the broker
    broker_down_s: float = 3.0
    nodes: int = 1
    heap: str = "384m"  # per broker node
    role_deck: tuple[str, ...] = ROLES  # the roles killed each round
    broker_deck: tuple[str, ...] | None = None  # the cluster's broker actions (None: CLUSTER_ACTIONS)
    session_timeout_ms: int | None = None  # the roles' consumers' session.timeout.ms (None: the client layer's)
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
        self.started_at: float | None = None

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}-{self.lifetime}.log"

    @property
    def worker_id(self) -> str | None:
        """A worker's id (its transactional id is ``<run>.rollout.<worker id>``)."""
        return self.argv[self.argv.index("--worker-id") + 1] if "--worker-id" in self.argv else None

    def start(self, env: dict[str, str], argv: list[str] | None = None) -> None:
        self.argv = argv or self.argv
        self.lifetime += 1
        self.restart_at = self.exited_at = None
        self.started_at = time.monotonic()
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
    """Seeded chaos actions: rounds of the shuffled role deck, and after each round the next broker action (until
    they are spent); None once ``rounds`` rounds (None: no limit) and the broker actions are dealt."""

    def __init__(self, rng: random.Random, role_deck: tuple[str, ...], broker_actions: list[str],
                 rounds: int | None):
        self.rng = rng
        self.role_deck = role_deck
        self.broker_actions = list(broker_actions)
        self.rounds_left = rounds
        self.deck: list[str] = []
        self.dealt = 0
        self._broker_dealt = True  # this round's broker action (none before the first round)

    def next_action(self) -> str | None:
        if not self.deck:
            if not self._broker_dealt and self.broker_actions:
                self._broker_dealt = True
                return self.broker_actions.pop(0)
            if self.rounds_left is not None:
                if self.rounds_left == 0:
                    return None
                self.rounds_left -= 1
            self.dealt += 1
            self._broker_dealt = False
            self.deck = self.rng.sample(self.role_deck, len(self.role_deck))
        return self.deck.pop()

    def defer(self, action: str) -> None:
        """Deal ``action`` again next time (its target was not ready: a role being restarted, a broker action
        still healing)."""
        if action in self.role_deck:
            self.deck.append(action)
        else:
            self.broker_actions.insert(0, action)
            self._broker_dealt = False

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
class BrokerAction:
    """One broker action on a cluster and what it cost (times are time.monotonic())."""

    name: str
    nodes: list[int]  # the nodes it took down, in order
    began: float  # the first node went down
    healed: float | None = None  # every replica back in sync
    note: str = ""  # why that node: "controller", "leader of rft.chaos.experiences[1]", ...
    loop_stall_s: float | None = None  # the longest gap between visible results from `began` on (ResultsProbe)

    @property
    def heal_s(self) -> float | None:
        return None if self.healed is None else self.healed - self.began


@dataclass
class Chaos:
    """What the harness did, for the report."""

    kills: Counter = field(default_factory=Counter)
    restarts: Counter = field(default_factory=Counter)  # restarts after a kill or crash, by role kind
    crashes: list[Crash] = field(default_factory=list)
    broker_restarts: int = 0  # broker nodes started again (after a SIGKILL or in a rolling restart)
    broker_same_port: bool | None = None
    broker_actions: list[BrokerAction] = field(default_factory=list)  # on a cluster
    results_median_gap_s: float | None = None  # the loop's pace when undisturbed, to read the stalls against
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
        if settings.nodes == 1:
            broker_actions = list(SINGLE_NODE_ACTIONS) * settings.broker_restarts
        else:
            broker_actions = list(settings.broker_deck or CLUSTER_ACTIONS)
        self.schedule = Schedule(random.Random(settings.seed + 1), settings.role_deck, broker_actions,
                                 settings.rounds)
        self.chaos = Chaos()
        self.began = time.monotonic()
        self.broker: EmbeddedBroker | None = None
        self.cluster_chaos: ClusterChaos | None = None
        self.probe: ResultsProbe | None = None
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
            "broker": {"nodes": s.nodes, "heap": s.heap},
            "kafka": {"consumer": {"session.timeout.ms": s.session_timeout_ms} if s.session_timeout_ms else {}},
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

    def start_broker(self) -> None:
        self.broker = EmbeddedBroker(load_config(self.config_path, env={}).broker, data_dir=self.out / "kafka",
                                     keep_data=True)
        with console.status(f"starting the {'broker' if self.s.nodes == 1 else f'{self.s.nodes}-node cluster'}…"):
            self.broker.start()
        console.print(f"{self.broker.kind} at {self.broker.bootstrap_servers} (data {self.broker.data_dir})")
        if self.s.nodes > 1:
            self.cluster_chaos = ClusterChaos(self)

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
        if self.s.nodes > 1:  # a clock for what each broker action costs the loop
            self.probe = ResultsProbe(self).start()
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
        self.event(self.chaos.aborted + "; stacks of the live roles in their logs")
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
        if self.cluster_chaos is not None:
            self.cluster_chaos.check()
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
            self.event(f"{role.name}#{role.lifetime} exited by itself (code {crash.exit_code})")
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
        if action in CLUSTER_ACTIONS:
            # one at a time (the last one is still healing), and only on a calm loop, so what it costs is its own
            if self.cluster_chaos.busy() or not self._roles_settled():
                self.schedule.defer(action)
            else:
                self.cluster_chaos.begin(action)
            return
        if self.cluster_chaos is not None and self.cluster_chaos.measuring():
            self.schedule.defer(action)  # a broker action's cost is still being measured
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
        self.event(f"SIGKILL {role.name}#{role.lifetime}")
        if role.kind == "trainer":
            self._snapshot_trainer(role, "killed")
        role.restart_at = time.monotonic() + self.rng.uniform(0.5, 3.0)

    def _roles_settled(self) -> bool:
        """Every role is up and none was (re)started in the last SETTLE_S (a trainer takes seconds to load)."""
        now = time.monotonic()
        return all(role.finished or (role.alive() and now - role.started_at >= SETTLE_S)
                   for role in self.roles.values())

    def event(self, what: str) -> None:
        line = f"t={time.monotonic() - self.began:.1f}s step {self.chaos.steps_done}: {what}"
        self.chaos.events.append(line)
        console.print(f"[magenta]{line}")

    def _snapshot_trainer(self, role: RoleProcess, how: str) -> None:
        """Before the next trainer truncates the audit to its checkpoint: keep what this lifetime left."""
        from streamrft.consumers.trainer.checkpoints import Checkpoints

        checkpoints = Checkpoints(self.out / "checkpoints", keep=1)
        steps = checkpoints.steps()
        self.chaos.trainer_lifetimes.append(TrainerLifetime(role.lifetime, how, checkpoints.audit(),
                                                            steps[-1] if steps else -1))
        if checkpoints.audit_path.exists():
            shutil.copy(checkpoints.audit_path, self.logs / f"trained-lifetime-{role.lifetime}.jsonl")

    def _restart_broker(self) -> None:
        """One node: SIGKILL, a pause, back on its data dir and its ports."""
        self.event(f"SIGKILL broker (pid {self.broker.pid})")
        self.broker.kill_node(1)  # reaps the dead JVM and its watchdog; keep_data: the data stays
        self.chaos.kills["broker"] += 1
        time.sleep(self.s.broker_down_s)
        try:
            self.broker.start_node(1)
            self.chaos.broker_same_port = True
            self.event(f"broker back on {self.bootstrap}")
        except BrokerError as exc:  # the old port was taken meanwhile: new address, so every role must restart
            console.print(f"[yellow]broker could not come back on {self.bootstrap}: {exc}; new ports, restarting "
                          "all roles")
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
                    self.event(f"{role.name}#{role.lifetime} hung at stop (stacks in its log)")

    def measure_stalls(self) -> None:
        """What each broker action cost the loop: the longest wait for a visible result from the moment it began
        until MEASURE_TAIL_S after the cluster was whole again."""
        if self.probe is None:
            return
        self.probe.stop()
        if self.probe.error is not None:
            self.event(f"the results probe failed, so the loop's stalls are unknown: {self.probe.error!r}")
            return
        self.chaos.results_median_gap_s = self.probe.median_gap()
        for action in self.chaos.broker_actions:
            until = (action.healed if action.healed is not None else action.began + 60) + MEASURE_TAIL_S
            action.loop_stall_s = self.probe.longest_gap(action.began, until)

    def settle_brokers(self) -> None:
        """Before the checks: the broker action in flight, if any, is over and the cluster whole again."""
        if self.cluster_chaos is not None:
            with console.status("waiting for the cluster to heal…"):
                self.cluster_chaos.join()
                self.broker.wait_in_sync()

    def kill_everything(self) -> None:
        for role in self.roles.values():
            if role.alive():
                role.kill()
        if self.probe is not None:
            self.probe.stop()
        if self.broker is not None:
            self.broker.stop()


class ChaosAbort(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# the brokers of a cluster, and what their failures cost the loop
# ---------------------------------------------------------------------------------------------------------------
class ClusterChaos:
    """Runs the cluster's broker actions (CLUSTER_ACTIONS), one at a time, each on a thread of its own so that the
    harness keeps supervising the roles meanwhile. The victim is chosen when the action begins; an action is over
    once every replica is back in sync, and only then can the next begin."""

    def __init__(self, run: "ChaosRun"):
        self.run = run
        self.broker = run.broker
        self.rng = random.Random(run.s.seed + 2)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def measuring(self) -> bool:
        """An action is in flight, or its cluster healed less than MEASURE_TAIL_S ago."""
        last = self.run.chaos.broker_actions[-1] if self.run.chaos.broker_actions else None
        return self.busy() or (last is not None and last.healed is not None
                               and time.monotonic() < last.healed + MEASURE_TAIL_S)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise ChaosAbort(f"a broker action failed: {self.error}") from self.error

    def begin(self, action: str) -> None:
        node, note = self._victim(action)
        record = BrokerAction(action, [], time.monotonic(), note=note)
        self.run.chaos.broker_actions.append(record)
        work = self._rolling_restart if action == "rolling-restart" else self._kill_and_restart
        self._thread = threading.Thread(target=self._guarded, args=(work, record, node), name=f"broker-{action}",
                                        daemon=True)
        self._thread.start()

    def _victim(self, action: str) -> tuple[int | None, str]:
        """The node an action takes down, and why that one."""
        if action == "random-empty-disk":
            return self.rng.choice([n.node_id for n in self.broker.nodes]), "random; back with an empty disk"
        if action == "controller":
            return self.broker.controller(), "the active KRaft controller"
        if action == "experiences-leader":
            topic = self.run.config().topic("experiences")
            ends = KafkaClients(self.run.config(), self.run.bootstrap).offsets(topic)
            (_, partition), records = max(ends.items(), key=lambda item: item[1])
            return self.broker.leader_of(topic, partition), f"leader of {topic}[{partition}] ({records} records)"
        if action == "coordinator":
            workers = [r for r in self.run.roles.values() if r.kind == "worker" and r.alive()]
            worker_id = self.rng.choice(workers).worker_id
            transactional_id = f"{RUN_NAME}.rollout.{worker_id}"
            return self.broker.transaction_coordinator(transactional_id), f"transaction coordinator of {worker_id}"
        return None, "all nodes, one at a time, the controller last"  # rolling-restart

    def _guarded(self, work, record: BrokerAction, node: int | None) -> None:
        try:
            work(record, node)
            record.healed = time.monotonic()
            self.run.event(f"{record.name}: cluster in sync again {record.heal_s:.1f} s after it began")
        except BaseException as exc:  # raised in the harness's thread by join() / check()
            self.error = exc

    def check(self) -> None:
        """Raise in the harness's thread what failed in an action's thread."""
        if self.error is not None and not self.busy():
            self.join()

    def _kill_and_restart(self, record: BrokerAction, node: int) -> None:
        empty_disk = record.name == "random-empty-disk"
        self.run.event(f"SIGKILL broker node {node} ({record.note})")
        self.broker.kill_node(node)
        record.nodes.append(node)
        self.run.chaos.kills["broker"] += 1
        time.sleep(self.run.s.broker_down_s)
        self.broker.start_node(node, empty_disk=empty_disk)
        self.run.chaos.broker_restarts += 1
        self.run.event(f"broker node {node} back{' with an empty disk' if empty_disk else ''}")
        self.broker.wait_in_sync()

    def _rolling_restart(self, record: BrokerAction, _node: None) -> None:
        """A rolling upgrade's restart: SIGTERM (a controlled shutdown), back, in sync, next; the controller last
        (it moves once, not once per node)."""
        controller = self.broker.controller()
        order = sorted((n.node_id for n in self.broker.nodes), key=lambda n: (n == controller, n))
        for node in order:
            self.run.event(f"rolling restart: stopping broker node {node}")
            self.broker.stop_node(node)
            record.nodes.append(node)
            self.broker.start_node(node)
            self.run.chaos.broker_restarts += 1
            self.broker.wait_in_sync()


class ResultsProbe:
    """When results become visible to a read_committed reader, as the explorer sees them: a thread that follows
    ``results`` from its start (group-less, commits nothing) and notes the time of each batch that arrives."""

    def __init__(self, run: "ChaosRun"):
        config = run.config()
        self.topic = config.topic("results")
        self.clients = KafkaClients(config, run.bootstrap)
        self.arrivals: list[float] = []
        self.stopped_at: float | None = None
        self.error: BaseException | None = None  # what ended the probe early, if anything
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="results-probe", daemon=True)

    def start(self) -> "ResultsProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        self._stop.set()
        self._thread.join(10)

    def _follow(self) -> None:
        consumer = None
        try:
            consumer = self.clients.consumer([self.topic], RolloutResult, f"{RUN_NAME}.chaos-probe",
                                             subscribe=False, dead_letters=False)
            consumer.assign(self.clients.offsets(self.topic, "start"))
            while not self._stop.is_set():
                if consumer.poll(max_records=500, timeout=0.2):
                    self.arrivals.append(time.monotonic())
        except BaseException as exc:  # reported by the harness (measure_stalls)
            self.error = exc
        finally:
            if consumer is not None:
                consumer.close()
            self.clients.close()

    def longest_gap(self, since: float, until: float) -> float:
        """The longest wait between two arrivals that overlaps [since, until]; a wait still going on when the
        probe stopped ends there. A loop that stopped at ``since`` and resumed at t waited t - the last arrival."""
        times = sorted(self.arrivals)
        if not times or times[0] > since:
            times.insert(0, since)
        times.append(max(self.stopped_at or until, times[-1]))
        return max((b - a for a, b in zip(times, times[1:]) if b > since and a < until), default=0.0)

    def median_gap(self) -> float | None:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return statistics.median(gaps) if gaps else None


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
    return observe_topics(run.config(), run.bootstrap, run.out / "checkpoints")


def observe_topics(config, bootstrap: str, checkpoint_dir: Path) -> Observed:
    """Every topic of the run of ``config`` as a read_committed reader sees it, and the trainer's final audit."""
    clients = KafkaClients(config, bootstrap)

    def read(name: str, record_type):
        topic = config.topic(name)
        return [clients.serde.decode(r.value, topic, record_type)
                for r in read_to_end(config.kafka, bootstrap, topic, timeout=120)]

    with console.status("reading every topic (read_committed)…"):
        topics = clients.admin().list_topics(timeout=10).topics
        letters = {name: read_to_end(config.kafka, bootstrap, name, timeout=120)
                   for name in sorted(topics) if name.startswith(config.topic_prefix) and name.endswith(".dlq")}
        refused = {_eid_of(clients, config, r.value) for r in letters.get(config.topic("experiences") + ".dlq", [])}
        observed = Observed(read("tasks", Task), read("rollouts", RolloutRequest), read("results", RolloutResult),
                            read("experiences", Experience), read("metrics", Metric), read("sync", SyncSignal),
                            {name: len(records) for name, records in letters.items()}, refused - {None}, [])
    clients.close()
    from streamrft.consumers.trainer.checkpoints import Checkpoints

    observed.audit = Checkpoints(checkpoint_dir, keep=1).audit()
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
    rows = [(f"kills {k}", chaos.kills[k]) for k in (*ROLES, "broker")]
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


def broker_table(chaos: Chaos) -> Table | None:
    """Each broker action on a cluster: whom it hit, how long until every replica was in sync again, and the
    longest the loop waited for a result meanwhile (beside its median gap when undisturbed)."""
    if not chaos.broker_actions:
        return None
    median = chaos.results_median_gap_s
    table = Table(title=f"broker actions (results arrive every {median:.2f} s, median)" if median is not None
                  else "broker actions", show_header=True)
    for column in ("action", "node(s)", "why that node", "in sync after (s)", "loop stalled (s)"):
        table.add_column(column, justify="right" if "(s)" in column else "left")
    for a in chaos.broker_actions:
        table.add_row(a.name, " ".join(map(str, a.nodes)), a.note, "-" if a.heal_s is None else f"{a.heal_s:.1f}",
                      "-" if a.loop_stall_s is None else f"{a.loop_stall_s:.1f}")
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
        for t in chaos.trainer_lifetimes], "broker_actions": [
        {"name": a.name, "nodes": a.nodes, "note": a.note, "in_sync_after_s": a.heal_s, "loop_stall_s": a.loop_stall_s}
        for a in chaos.broker_actions]}, "figures": verdict.figures, "violations": verdict.violations}
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
            run.settle_brokers()
        except ChaosAbort as exc:
            run.chaos.aborted = str(exc)
        run.stop_workers()
        run.measure_stalls()
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
                        help="rounds of kills, one of each role per round (default: until the window ends; with "
                             "--nodes 3, until every broker action is dealt)")
    parser.add_argument("--broker-restarts", type=int, default=1, help="broker restarts during the window, one "
                        "node (1)")
    parser.add_argument("--nodes", type=int, default=1, help="broker nodes: 1, or 3 for a replicated cluster and its "
                        "broker actions (1)")
    parser.add_argument("--broker-down-s", type=float, default=3.0, help="seconds a killed broker node stays down (3)")
    parser.add_argument("--session-timeout-ms", type=int, default=None,
                        help="the roles' consumer session.timeout.ms (default: the client layer's, 10000)")
    parser.add_argument("--batch-size", type=int, default=4, help="tasks per step (4)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="give up on the run after this (1200)")
    parser.add_argument("--out", type=Path, default=None, help="a new directory (default: runs/chaos-<seed>)")
    args = parser.parse_args(argv)
    rounds = args.rounds
    if rounds is None and args.nodes > 1:
        rounds = len(CLUSTER_ACTIONS)
    settings = ChaosSettings(out=args.out or Path(f"runs/chaos-{args.seed}"), seed=args.seed, steps=args.steps,
                             workers=args.workers, kill_every_s=args.kill_every_s, duration_s=args.duration_s,
                             rounds=rounds, broker_restarts=args.broker_restarts, batch_size=args.batch_size,
                             timeout_s=args.timeout_s, nodes=args.nodes, broker_down_s=args.broker_down_s,
                             session_timeout_ms=args.session_timeout_ms)
    signal.signal(signal.SIGTERM, _interrupt)
    outcome = run_chaos(settings)
    wide = Console(width=max(Console().width, 120))  # the broker actions' notes are long
    wide.print(report(outcome.chaos, outcome.verdict, outcome.observed))
    brokers = broker_table(outcome.chaos)
    if brokers is not None:
        wide.print(brokers)
    print_crashes(outcome.chaos)
    for log in outcome.chaos.stacks:
        console.print(f"[yellow]HUNG[/] stacks in {log}")
    print_violations(outcome.verdict)
    console.print(f"logs in {settings.out / 'logs'}, figures in {settings.out / 'chaos.json'}")
    return 0 if outcome.verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
