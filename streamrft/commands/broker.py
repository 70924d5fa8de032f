"""``streamrft broker``: a long-lived embedded Kafka broker (one node, or a cluster with ``--nodes 3``) for a
session of commands.

Without it every command starts (and stops) a broker of its own; with ``streamrft broker start`` running, they all
share that one (``kafka_for`` finds it through the state file). ``setup`` resolves the jars ahead of time.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import time

from pydantic import ValidationError
from rich.console import Console

from ..broker import EmbeddedBroker, ensure_jars
from ..broker.state import (BrokerState, clear_state, read_state, running_broker, terminate, user_topic_count,
                            write_state)
from ..config import EmbeddedBrokerConfig, load_config
from ..errors import ConfigError

console = Console(stderr=True)


def register(subparsers) -> None:
    parser = subparsers.add_parser("broker", help="start, stop or inspect the embedded Kafka broker (or cluster)")
    actions = parser.add_subparsers(dest="broker_action", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start a broker in the background and print its bootstrap address")
    _config_argument(start)
    start.add_argument("--data-dir", default=None, help="the broker's data directory, new or empty (default: a temporary one); deleted at stop "
                       "unless --keep-data")
    start.add_argument("--keep-data", action="store_true", help="do not delete the data when the broker stops")
    start.add_argument("--nodes", type=int, default=None,
                       help="KRaft nodes: 1, or 3 to 5 for a replicated cluster (default: the config's broker.nodes)")
    start.add_argument("--foreground", action="store_true", help="run in this terminal until Ctrl-C")
    start.set_defaults(func=start_broker)

    stop = actions.add_parser("stop", help="stop the broker started by `streamrft broker start`")
    stop.add_argument("--timeout", type=float, default=20.0, help="seconds to wait before killing it (20)")
    stop.set_defaults(func=stop_broker)

    status = actions.add_parser("status", help="is a broker running; where; how many topics (exit 1 if not)")
    status.set_defaults(func=broker_status)

    setup = actions.add_parser("setup", help="download the broker's jars now (Maven) and check that it starts")
    _config_argument(setup)
    setup.add_argument("--no-check", action="store_true", help="only resolve the jars; do not start a broker")
    setup.set_defaults(func=setup_broker)


def _config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", default=None, metavar="CONFIG",
                        help="run configuration whose `broker:` section (version, heap, timeout) to use")


def start_broker(args: argparse.Namespace) -> int:
    recorded = read_state()
    if recorded is not None and recorded.alive_pids():
        answering = "running" if running_broker() else "recorded (but not answering)"
        console.print(f"a broker is already {answering} at {recorded.bootstrap_servers} (pid {recorded.pid}); "
                      "`streamrft broker stop` it first")
        return 1
    if recorded is not None:  # its process is gone (killed, machine rebooted): drop the record and its data
        _remove_data(recorded)
        clear_state()
    config = load_config(args.config).broker
    if args.nodes is not None:  # validated as the config key is: a bad count is refused with how to fix it
        config = _with_nodes(config, args.nodes)
    keep_data = True if args.keep_data else None  # None: the config's broker.keep_data
    broker = EmbeddedBroker(config, data_dir=args.data_dir, keep_data=keep_data, detached=not args.foreground)
    what = "a broker" if config.nodes == 1 else f"a {config.nodes}-node cluster"
    with console.status(f"starting Apache Kafka {config.kafka_version}, {what}…"):
        broker.start()
    if args.foreground:
        return _run_in_foreground(broker)
    write_state(broker.detach())
    console.print(f"Kafka {config.kafka_version} {broker.kind} running at {broker.bootstrap_servers} "
                  f"(started in {broker.startup_s:.1f} s, data {broker.data_dir}); stop it with "
                  "`streamrft broker stop`")
    print(broker.bootstrap_servers)
    return 0


def _with_nodes(config: EmbeddedBrokerConfig, nodes: int) -> EmbeddedBrokerConfig:
    try:
        return EmbeddedBrokerConfig.model_validate({**config.model_dump(), "nodes": nodes})
    except ValidationError as exc:
        raise ConfigError(f"--nodes {nodes}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def _run_in_foreground(broker: EmbeddedBroker) -> int:
    """Serve until Ctrl-C or SIGTERM; meanwhile other commands find this broker through the state file."""
    state = BrokerState(pid=broker.pid, bootstrap_servers=broker.bootstrap_servers, data_dir=str(broker.data_dir),
                        keep_data=broker.keep_data, cluster_id=broker.cluster_id or "",
                        kafka_version=broker.config.kafka_version, started_at=time.time(), pids=broker.pids,
                        nodes=len(broker.nodes))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    write_state(state)
    console.print(f"Kafka {broker.kind} running at {broker.bootstrap_servers} (pids "
                  f"{' '.join(map(str, broker.pids))}, log {broker.log_file}); Ctrl-C stops it")
    print(broker.bootstrap_servers, flush=True)
    try:
        while any(node.running() for node in broker.nodes):
            time.sleep(0.5)
        console.print("the broker exited (stopped by `streamrft broker stop`?)")
    except KeyboardInterrupt:
        pass
    finally:
        if read_state() == state:
            clear_state()
        broker.stop()
    return 0


def stop_broker(args: argparse.Namespace) -> int:
    state = read_state()
    if state is None:
        console.print("no broker started by `streamrft broker start` is running")
        return 0
    pids = " ".join(map(str, state.all_pids))
    if state.alive_pids():
        graceful = terminate(state.all_pids, state.data_dir, timeout=args.timeout)
        how = "stopped" if graceful else f"killed (it did not stop within {args.timeout:g} s)"
        console.print(f"broker at {state.bootstrap_servers} (pid {pids}) {how}")
    else:
        console.print(f"the broker recorded at {state.bootstrap_servers} (pid {pids}) was not running")
    _remove_data(state)
    clear_state()
    return 0


def broker_status(args: argparse.Namespace) -> int:
    state = running_broker()
    if state is None:
        console.print("no broker is running (start one with `streamrft broker start`)")
        return 1
    topics = user_topic_count(state.bootstrap_servers)
    uptime = time.time() - state.started_at
    alive = state.alive_pids()
    nodes = "" if state.nodes == 1 else f"{len(alive)} of {state.nodes} nodes up, "
    console.print(f"running: Kafka {state.kafka_version} at {state.bootstrap_servers}, {nodes}"
                  f"pid {' '.join(map(str, alive))}, up {uptime / 60:.0f} min, {topics} topics, data {state.data_dir}"
                  f"{' (kept)' if state.keep_data else ''}")
    print(state.bootstrap_servers)
    return 0


def setup_broker(args: argparse.Namespace) -> int:
    """Resolve the jars and, unless --no-check, start and stop a broker once: that proves Java and the jars
    work, and leaves the class-data archive that makes later starts faster."""
    config = load_config(args.config).broker
    lib = ensure_jars(config.kafka_version)
    console.print(f"Apache Kafka {config.kafka_version} jars in {lib}")
    if not args.no_check:
        with console.status("checking that the broker starts…"), EmbeddedBroker(config) as broker:
            seconds = broker.startup_s
        console.print(f"broker check passed: ready (transactions included) in {seconds:.1f} s")
    return 0


def _remove_data(state: BrokerState) -> None:
    if state.keep_data:
        console.print(f"data kept in {state.data_dir} (`streamrft broker start --data-dir {state.data_dir} "
                      "--keep-data` resumes it)")
    else:
        shutil.rmtree(state.data_dir, ignore_errors=True)
