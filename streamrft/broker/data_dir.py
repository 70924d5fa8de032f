"""The embedded broker's data dir: one node keeps its files in the data dir itself; a cluster has ``node-1`` …
``node-N`` under it (and one ``security/`` for all). The broker deletes its data dir at stop unless it is kept, so
it never adopts a directory that holds anything else, nor one of a broker of another size (a static KRaft quorum
cannot grow or shrink)."""
from __future__ import annotations

import re
import tempfile
from importlib import resources
from pathlib import Path

from ..errors import BrokerError
from .node import JVM_OUT, LOG_FILE, STORAGE
from .security import SECURITY_DIR

NODE_DIR = "node-{}"  # a cluster node's data, under the broker's data dir


def node_dir(data_dir: Path, nodes: int, node_id: int) -> Path:
    """Where node ``node_id`` of a broker of ``nodes`` nodes keeps its files."""
    return data_dir if nodes == 1 else data_dir / NODE_DIR.format(node_id)


def prepare_data_dir(given: Path | None, nodes: int) -> Path:
    """The data dir (``given``, else a new temporary one) with a directory and a log4j2 configuration for each
    node; BrokerError if ``given`` holds anything but a broker of ``nodes`` nodes."""
    if given is None:
        data_dir = Path(tempfile.mkdtemp(prefix="streamrft-kafka-"))
    else:
        data_dir = given
        data_dir.mkdir(parents=True, exist_ok=True)
        check_holds_ours(data_dir, nodes)
    for node_id in range(1, nodes + 1):
        directory = node_dir(data_dir, nodes, node_id)
        directory.mkdir(exist_ok=True)
        (directory / "log4j2.properties").write_text(
            resources.files(__package__).joinpath("log4j2.properties").read_text())
    return data_dir


def check_holds_ours(data_dir: Path, nodes: int) -> None:
    names = {p.name for p in data_dir.iterdir()}
    node_dirs = {n for n in names if re.fullmatch(NODE_DIR.format(r"\d+"), n)}
    node_files = {STORAGE, "server.properties", "log4j2.properties", LOG_FILE, JVM_OUT, "classes.jsa"}
    strangers = sorted(names - node_files - node_dirs - {SECURITY_DIR})
    held = max((int(n.split("-")[1]) for n in node_dirs), default=1 if STORAGE in names else 0)
    problem = None
    if strangers:
        problem = f"holds files that are not the broker's ({', '.join(strangers[:5])})"
    elif held and held != nodes:
        problem = (f"holds the data of a {held}-node broker and broker.nodes is {nodes}; start it with "
                   f"broker.nodes: {held}, or")
    if problem:
        raise BrokerError(f"{data_dir} {problem}; give broker.data_dir / --data-dir a new or empty directory")
