"""Running roles inside a test: each in a thread with its own stop flag (role processes are tested in e2e)."""
from __future__ import annotations

import threading
from collections import Counter

from streamrft.kafka.reader import read_topic
from streamrft.lifecycle import StopSignal


class RoleThread:
    """Runs ``factory(stop).run()`` in a daemon thread and keeps its exception, if any."""

    def __init__(self, name: str, factory):
        self.stop = StopSignal()
        self.error: BaseException | None = None
        self.result = None
        self.role = None
        self._factory = factory
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        try:
            self.role = self._factory(self.stop)
            try:
                self.result = self.role.run()
            finally:
                self.role.close()
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def start(self) -> "RoleThread":
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"{self.thread.name} did not finish in {timeout:.0f}s")
        if self.error is not None:
            raise self.error


def produce_tasks(clients, config, tasks) -> None:
    """Put ``tasks`` on the run's ``tasks`` topic, delivered before returning."""
    from streamrft.producers import task_producer

    task_producer.produce_tasks(clients.producer(), config.topic("tasks"), tasks)


def wait_for_explorer_step(explorer: RoleThread, step: int, timeout: float) -> None:
    """Wait until the explorer role has finished ``step``."""
    import time

    deadline = time.monotonic() + timeout
    while explorer.role is None or explorer.role.state.finished_step < step:
        assert time.monotonic() < deadline, f"step {step} did not finish"
        time.sleep(0.2)


def wait_for(main: RoleThread, helpers: list[RoleThread], timeout: float) -> None:
    """Join ``main``, failing at once if one of ``helpers`` dies on the way (instead of timing out)."""
    import time

    deadline = time.monotonic() + timeout
    while main.thread.is_alive():
        for helper in helpers:
            if helper.error is not None:
                main.stop.request()
                raise RuntimeError(f"{helper.thread.name} died") from helper.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"{main.thread.name} did not finish in {timeout:.0f}s")
        main.thread.join(0.5)
    main.join(0)


def read_all(config, bootstrap: str, name: str, serde, record_type, idle: float = 2.0):
    topic = config.topic(name)
    return [serde.decode(r.value, topic, record_type) for r in read_topic(config.kafka, bootstrap, topic,
                                                                          idle_timeout=idle)]


def group_sizes(experiences) -> Counter:
    return Counter(e.group_id for e in experiences)


def write_config(config, path) -> str:
    """A RunConfig as a YAML file a role subprocess can load (the bootstrap travels in the file)."""
    import yaml

    data = config.model_dump(mode="json", by_alias=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def role_process(command: list[str], config_path: str, log_path, **env):
    """Start ``streamrft <command> CONFIG`` as its own process (its output goes to ``log_path``)."""
    import os
    import subprocess
    import sys

    environment = {**os.environ, "STREAMRFT_LOG_LEVEL": "INFO", **env}
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "streamrft.cli", command[0], config_path, *command[1:]],
                            stdout=log, stderr=subprocess.STDOUT, env=environment)


def train_beside_a_child(trainer: RoleThread, target, args: tuple, trainer_timeout: float,
                         child_timeout: float) -> None:
    """Run ``target(*args)`` in a spawned process while ``trainer`` runs; both must finish cleanly."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    try:
        trainer.join(trainer_timeout)
        child.join(child_timeout)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
