"""``streamrft run CONFIG``: the whole RL loop on this machine.

1. start the embedded broker (its data under runs/<name>/kafka, kept for --resume; ``broker.nodes: 3`` a
   replicated cluster) or use the configured cluster;  2. create the run's topics, and with ``broker.security`` on
   a principal per role with its ACLs (``streamrft.principals``);  3. produce the config's task files and data
   files (not on --resume);
4. start the explorer, the trainer, the monitor and N rollout workers, each as its own process (the roles of the
   run's shape, ``streamrft/run_shape.py``: in ``mode: train`` the trainer and the monitor only; in ``explore``
   no trainer);
5. show the live dashboard until the explorer and trainer finish; a role that crashes is started again after a
   back-off, and a crash loop stops the run with the role's log tail (``launch.restart``,
   ``streamrft/launch/supervisor.py``); Ctrl-C stops every role cleanly and leaves a run that `--resume` continues.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import time
from contextlib import nullcontext
from pathlib import Path

from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ..broker import EmbeddedBroker, check_replication
from ..config import RunConfig
from ..errors import StreamrftError
from ..kafka import KafkaClients, unanswered
from ..launch.dashboard import MetricsFollower, group_lags, render, sync_line
from ..launch.metrics import LauncherMetrics
from ..launch.processes import RoleProcess, stop_all
from ..launch.supervisor import Supervisor
from ..lifecycle import StopSignal
from ..registry.for_run import REGISTRY_URL_ENV, registry_for
from ..sync import SyncView
from ..telemetry import serve_prometheus
from streamrft.producers.task_files import FieldMapping, count_rows, read_tasks
from streamrft.producers.task_producer import produce_tasks
from .common import add_config_argument, config_from, console

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run the whole loop here: broker, explorer, workers, trainer, "
                                               "monitor, with a live dashboard")
    add_config_argument(parser, positional=True)
    parser.add_argument("--resume", action="store_true", help="continue a run stopped earlier")
    parser.add_argument("--workers", type=int, default=None, help="rollout workers (default: launch.rollout_workers)")
    parser.add_argument("--no-dashboard", action="store_true", help="log lines instead of the live view")
    parser.add_argument("--accept-offset-reset", action="store_true",
                        help="the trainer reads on from its consumer group's offsets when someone else reset them "
                             "(streamrft train --accept-offset-reset), instead of stopping")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    run_dir = config.output_dir
    with _cluster(config, run_dir, args.resume) as cluster, registry_for(cluster.config, console) as on_registry:  # 1.
        cluster.config = on_registry  # schema_registry.url: embedded becomes the started registry's address
        clients = KafkaClients(cluster.config, cluster.config.kafka.bootstrap_servers)
        if cluster.config.kafka.authenticated:
            clients.check_credentials()
        clients.ensure_topics()  # 2.
        credentials = cluster.principals(clients)
        if args.resume:
            _check_resumable(config, clients)
        else:
            _produce_task_files(config, clients)  # 3.
            _produce_data_files(config, clients)
        registry = cluster.config.schema_registry.url if config.schema_registry.embedded else ""
        processes = _role_processes(config, args, cluster.config.kafka.bootstrap_servers, run_dir, credentials,
                                    registry)  # 4.
        try:
            return _supervise(config, clients, processes, run_dir, not args.no_dashboard)  # 5.
        finally:
            clients.close()


class _Cluster:
    """The run's cluster as the launcher uses it: its config (with the admin's principal on a secured embedded
    broker), and the principals of the roles."""

    def __init__(self, config: RunConfig, broker: EmbeddedBroker | None = None):
        self.config = config
        self.broker = broker

    def principals(self, admin: KafkaClients) -> dict[str, Path]:
        """role -> its credentials file, when the embedded broker runs with security on (users and ACLs
        created now, or again on --resume); empty otherwise: the roles connect as this config says."""
        if self.broker is None or self.broker.security is None:
            return {}
        from ..principals import provision

        with console.status("creating a principal and its ACLs for each role"):
            files = provision(admin, self.broker.security.credentials_dir)
        console.print(f"each role has its own principal ({', '.join(sorted(files))}); credentials in "
                      f"{self.broker.security.credentials_dir}")
        return files


def _cluster(config: RunConfig, run_dir: Path, resume: bool):
    if not config.kafka.embedded:
        return nullcontext(_Cluster(config))
    data_dir = run_dir / "kafka"
    if data_dir.exists() and not resume:
        raise StreamrftError(f"run {config.name!r} already exists ({run_dir}); continue it with --resume, or "
                             f"delete {run_dir} / set another `name` to start over")
    if resume and not data_dir.exists():
        raise StreamrftError(f"nothing to resume: {data_dir} does not exist; start the run without --resume")
    check_replication(config, config.broker.nodes)
    return _BrokerBootstrap(config, EmbeddedBroker(config.broker, data_dir=data_dir, keep_data=True))


class _BrokerBootstrap:
    def __init__(self, config: RunConfig, broker: EmbeddedBroker):
        self.config = config
        self.broker = broker

    def __enter__(self) -> _Cluster:
        nodes = self.config.broker.nodes
        with console.status("starting the embedded Kafka broker" if nodes == 1 else
                            f"starting the embedded Kafka cluster ({nodes} KRaft nodes)"):
            self.broker.start()
        security = self.broker.security
        replicated = "" if nodes == 1 else (f", {nodes} nodes, replication factor "
                                            f"{self.config.broker.replication_factor}, min.insync.replicas "
                                            f"{self.config.broker.min_insync_replicas}")
        console.print(f"{self.broker.kind} up at {self.broker.bootstrap_servers} (data in "
                      f"{self.broker.data_dir}{replicated}{', security ' + security.mode if security else ''})")
        admin = security.admin if security else None
        return _Cluster(self.config.on_cluster(self.broker.bootstrap_servers, admin), self.broker)

    def __exit__(self, *exc) -> None:
        self.broker.stop()


def _check_resumable(config: RunConfig, clients: KafkaClients) -> None:
    what = config.shape.input_topic
    topic = clients.config.topic(what)
    if not any(report.end_offsets_total for report in clients.describe() if report.name == topic):
        raise StreamrftError(f"the run has no {what} to resume; start it without --resume")


def _produce_task_files(config: RunConfig, clients: KafkaClients) -> None:
    if not config.shape.has_explorer:
        return  # no explorer to read tasks
    if not config.launch.task_files:
        console.print("[yellow]launch.task_files is empty: inject tasks with `streamrft tasks produce`[/]")
        return
    producer = clients.producer(client_id="launcher")
    topic = config.topic("tasks")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console) as progress:
        for task_file in config.launch.task_files:
            bar = progress.add_task(f"tasks from {task_file.path}", total=count_rows(task_file.path))
            summary = produce_tasks(producer, topic, read_tasks(task_file.path, FieldMapping.from_task_file(task_file)),
                                    on_item=lambda b=bar: progress.advance(b))
            if summary.rejected:
                first = summary.rejected[0]
                raise StreamrftError(f"{task_file.path}: {len(summary.rejected)} row(s) cannot become tasks "
                                     f"(first: line {first.line}: {first.reason}); fix the file")


def _produce_data_files(config: RunConfig, clients: KafkaClients) -> None:
    """launch.data_files -> supervised experiences (as ``streamrft data produce`` does); a row that cannot be
    used stops the run before any role starts, as a bad task file does."""
    from .data import produce_with_progress, supervised_items
    from streamrft.producers.chat_rows import ChatMapping

    if config.shape.trainer_reads_supervised_only and not config.launch.data_files:
        console.print("[yellow]launch.data_files is empty: produce the data with `streamrft data produce`[/]")
    producer = clients.producer(client_id="launcher")
    for data_file in config.launch.data_files:
        with console.status(f"loading {config.model.path} for {data_file.path}"):
            items = supervised_items(config, data_file.path, data_file.objective, ChatMapping.from_data_file(data_file))
        summary = produce_with_progress(producer, config, data_file.path, items)
        if summary.rejected:
            first = summary.rejected[0]
            raise StreamrftError(f"{data_file.path}: {len(summary.rejected)} row(s) cannot become "
                                 f"{data_file.objective} experiences (first: line {first.line}: {first.reason}); fix "
                                 "the file (`streamrft data produce --rejects FILE` lists every one)")


# The roles share this machine's cores. OpenMP threads spin while they wait for work by default, so two torch
# processes (rollout generating while the trainer trains) burn each other's CPU: on 2 cores, a training step
# overlapping generation took 83 s instead of 26 s, generation 62 s instead of 22 s. Passive waiting yields the
# core instead. A value the user set is kept.
SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def role_environment(bootstrap: str, registry_url: str = "") -> dict[str, str]:
    """What every role process gets on top of this process's environment (``registry_url``: the embedded
    registry's address, which the config's ``embedded`` stands for)."""
    env = {k: v for k, v in SHARED_CORES_ENV.items() if k not in os.environ}
    env["STREAMRFT_KAFKA__BOOTSTRAP_SERVERS"] = bootstrap
    if registry_url:
        env[REGISTRY_URL_ENV] = registry_url
    return env


GROUP_SECRET_ENV = "STREAMRFT_TRAINER__WEIGHTS__GROUP_SECRET"


def weight_sync_secret(config: RunConfig) -> dict[str, str]:
    """A per-run ``trainer.weights.group_secret`` for the collective weight-sync group, for the trainer's and the
    workers' environments only (which no other user's process can read); one the user set is kept."""
    weights = config.trainer.weights
    if weights.method != "collective" or weights.group_secret is not None or GROUP_SECRET_ENV in os.environ:
        return {}
    return {GROUP_SECRET_ENV: secrets.token_urlsafe(32)}


def _role_processes(config: RunConfig, args: argparse.Namespace, bootstrap: str, run_dir: Path,
                    credentials: dict[str, Path], registry_url: str = "") -> list[RoleProcess]:
    logs = run_dir / "logs"

    def env(role: str, **extra: str) -> dict[str, str]:
        """The role's environment; with per-role principals, its own credentials file (not the password)."""
        principal = {"STREAMRFT_KAFKA__CREDENTIALS_FILE": str(credentials[role])} if role in credentials else {}
        return {**role_environment(bootstrap, registry_url), **principal, **extra}

    roles = config.shape.roles
    sync_secret = weight_sync_secret(config)
    processes = []
    if "explorer" in roles:
        processes.append(RoleProcess("explorer", ["explorer", args.config], logs / "explorer.log", env("explorer")))
    if "trainer" in roles:
        accept = ["--accept-offset-reset"] if args.accept_offset_reset else []
        processes.append(RoleProcess("trainer", ["train", args.config, *accept], logs / "trainer.log",
                                     env("trainer", **sync_secret)))
    processes.append(RoleProcess("monitor", ["monitor", args.config], logs / "monitor.log", env("monitor")))
    workers = 0 if "rollout" not in roles else config.launch.rollout_workers if args.workers is None else args.workers
    base = config.launch.rollout_metrics_port_base
    for i in range(workers):
        port = str(base + i if base else 0)
        processes.append(RoleProcess(f"rollout-{i}", ["rollout", args.config, "--worker-id", f"rollout-{i}"],
                                     logs / f"rollout-{i}.log", env("rollout", STREAMRFT_ROLLOUT__METRICS_PORT=port,
                                                                    **sync_secret)))
    for process in processes:
        process.start()
    console.print(f"started {', '.join(p.name for p in processes)}; logs in {logs}")
    return processes


def _supervise(config: RunConfig, clients: KafkaClients, processes: list[RoleProcess], run_dir: Path,
               dashboard: bool) -> int:
    by_name = {p.name: p for p in processes}
    metrics = LauncherMetrics(p.name for p in processes)
    endpoint = serve_prometheus(config.launch.metrics_port, metrics.registry, config.metrics_host)
    supervisor = Supervisor(processes, config.launch.restart, metrics=metrics)
    follower = MetricsFollower(clients)
    explorer = SyncView(clients, client_id="dashboard-sync")  # the explorer's state: steps in flight, waits
    started = time.monotonic()
    lags: dict[str, int] = {}
    reported: set[int] = set()
    last_refresh = 0.0
    outcome = 0
    crash_loop = None
    with StopSignal() as stop, (Live(console=console, refresh_per_second=2) if dashboard else nullcontext()) as live:
        while True:
            follower.poll()
            explorer.poll(0)
            if time.monotonic() - last_refresh > config.launch.dashboard_refresh_s:
                lags = _group_lags_or(lags, clients)
                last_refresh = time.monotonic()
                if live is not None:
                    live.update(render(follower, lags, processes, started, config.name,
                                       max_steps=config.explorer.max_steps, sync=sync_line(config, explorer.explorer)))
                else:
                    _log_new_steps(follower, reported)
            if stop.requested:
                outcome = 130
                break
            crash_loop = supervisor.check()
            if crash_loop is not None:
                outcome = 1
                break
            if all(by_name[name].returncode == 0 for name in ("explorer", "trainer") if name in by_name):
                break
            time.sleep(0.2)
    follower.close()
    explorer.close()
    endpoint.close()
    if crash_loop is not None:
        console.print(crash_loop, markup=False, highlight=False, style="red")
    if supervisor.restarts():
        console.print("restarts: " + ", ".join(f"{name} {n}" for name, n in sorted(supervisor.restarts().items())))
    with console.status("stopping the roles"):
        time.sleep(2 if outcome == 0 else 0)  # let the monitor drain the last metrics
        stop_all(processes)
    if outcome == 130:
        console.print("stopped; every role left cleanly. Continue with the same command plus --resume")
    else:
        _final_report(run_dir)
    return outcome


def _group_lags_or(last: dict[str, int], clients: KafkaClients) -> dict[str, int]:
    """The groups' lags, or the last ones while the cluster does not answer (a broker failing over): the run goes
    on without a human, so must its dashboard."""
    try:
        return group_lags(clients)
    except Exception as exc:  # the client layer's KafkaException; only its kind is known here
        if not unanswered(exc):
            raise
        logger.warning("consumer group lags unknown for now (%s); showing the last ones", exc)
        return last


def _log_new_steps(follower: MetricsFollower, reported: set[int]) -> None:
    explorer = follower.by_role.get("explorer", {})
    reported.intersection_update(explorer)  # the steps the follower still keeps: bounded over a long run
    for step, values in sorted(explorer.items()):
        if step not in reported and "rollout/tasks" in values:
            reported.add(step)
            console.print(f"step {step}: reward {values.get('rollout/reward_mean', float('nan')):.3f}, accuracy "
                          f"{values.get('rollout/accuracy', float('nan')):.3f}, weights "
                          f"v{values.get('rollout/model_version', 0):.0f}, {values.get('time/step_s', 0):.1f}s")


def _final_report(run_dir: Path) -> None:
    from streamrft.consumers.monitor import METRICS_CSV
    from .report import write_report

    if (run_dir / METRICS_CSV).exists():
        console.print(f"report: {write_report(run_dir)}")
