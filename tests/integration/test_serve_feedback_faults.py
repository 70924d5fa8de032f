"""Serve mode's promise under faults: every feedback answered 200 is exactly one Experience on
``experiences``, through a load of concurrent clients, one broker restart and one SIGKILL + restart of the server
(``streamrft serve`` in a process of its own, with a fixed ``serve.server_id``, so that the new server fences what
the old one left open).

Clients do what a careful agent application does: a feedback that got no definite answer (503, a connection
refused while the server is down, a timeout) is sent again until it gets one (200, or 404 once the server that
held the completion is gone); and now and then a feedback answered 200 is sent again on purpose (a retry after a
lost answer), which must be answered the same and write nothing. The broker of this test is its own, restarted
on its ports (the session's broker serves other tests)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from streamrft.broker import EmbeddedBroker
from streamrft.config import load_config
from streamrft.kafka import KafkaClients
from streamrft.schemas import Experience

from .roles import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.model, pytest.mark.slow]

KEY = "sk-streamrft-faults"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CLIENTS = 6


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``streamrft serve`` in a process (group) of its own."""

    def __init__(self, config_file: Path, port: int, log: Path) -> None:
        self.config_file, self.port, self.log = config_file, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.lifetimes = 0

    def start(self) -> None:
        self.lifetimes += 1
        streamrft = Path(sys.executable).with_name("streamrft")
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([str(streamrft), "serve", str(self.config_file), "--port", str(self.port)],
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}):\n{self.tail()}"
            assert time.monotonic() < deadline, f"the server did not answer:\n{self.tail()}"
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


@dataclass
class Ledger:
    """What the clients were told, shared by their threads."""

    acknowledged: dict[tuple[str, int], str] = field(default_factory=dict)  # (response id, choice) -> eid
    rewards: dict[tuple[str, int], float] = field(default_factory=dict)
    replayed: int = 0  # a 200 sent again on purpose, answered the same
    retried: int = 0  # sent again after no definite answer
    gone: int = 0  # 404 after the server holding the completion went away
    acknowledged_at: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acknowledge(self, key: tuple[str, int], eid: str, reward: float) -> None:
        with self.lock:
            assert key not in self.acknowledged or self.acknowledged[key] == eid, (key, eid)
            self.acknowledged[key] = eid
            self.rewards[key] = reward
            self.acknowledged_at.append(time.monotonic())


def send_feedback(base: str, response_id: str, choice: int, reward: float, ledger: Ledger,
                  stop: threading.Event) -> httpx.Response | None:
    """Until a definite answer: 200, 404 or 409 (None if the test ends first)."""
    body = {"response_id": response_id, "choice": choice, "reward": reward}
    while True:
        try:
            answer = httpx.post(f"{base}/feedback", json=body, headers=HEADERS, timeout=30)
            if answer.status_code in (200, 404, 409):
                return answer
        except httpx.HTTPError:
            pass
        if stop.is_set():
            return None
        ledger.retried += 1
        time.sleep(0.3)


def client(index: int, base: str, ledger: Ledger, stop: threading.Event, errors: list) -> None:
    rng = random.Random(index)
    while not stop.is_set():
        try:
            answer = httpx.post(f"{base}/v1/chat/completions", headers=HEADERS, timeout=30, json={
                "model": "tiny", "n": 2, "max_tokens": 6, "seed": rng.randrange(1 << 30),
                "messages": [{"role": "user", "content": f"What is {rng.randrange(20)} + {rng.randrange(20)}?"}]})
        except httpx.HTTPError:
            time.sleep(0.3)  # the server is down: its restart is part of the test
            continue
        if answer.status_code != 200:
            if answer.status_code not in (429, 503, 504):
                errors.append(f"completion: {answer.status_code} {answer.text[:200]}")
            time.sleep(0.3)
            continue
        response_id = answer.json()["id"]
        for choice in (0, 1):
            reward = float(rng.choice([0.0, 0.5, 1.0]))
            given = send_feedback(base, response_id, choice, reward, ledger, stop)
            if given is None:
                return
            if given.status_code == 404:
                ledger.gone += 1
                continue
            if given.status_code != 200:
                errors.append(f"feedback {response_id}/{choice}: {given.status_code} {given.text[:200]}")
                continue
            eid = given.json()["eid"]
            ledger.acknowledge((response_id, choice), eid, reward)
            if rng.random() < 0.25:  # the client did not see the answer and sends it again
                again = send_feedback(base, response_id, choice, reward, ledger, stop)
                if again is not None:
                    assert again.status_code == 200 and again.json()["eid"] == eid, (again.status_code, again.text)
                    ledger.replayed += 1


def wait_for_more(ledger: Ledger, count: int, timeout_s: float, server: Server) -> None:
    target = len(ledger.acknowledged) + count
    deadline = time.monotonic() + timeout_s
    while len(ledger.acknowledged) < target:
        assert time.monotonic() < deadline, (f"only {len(ledger.acknowledged)} of {target} feedback acknowledged\n"
                                             f"{server.tail()}")
        time.sleep(0.2)


def test_every_acknowledged_feedback_is_exactly_one_experience_through_a_broker_restart_and_a_server_sigkill(
        tmp_path, tiny_model_dir):
    broker = EmbeddedBroker(data_dir=tmp_path / "kafka", keep_data=True).start()
    server: Server | None = None
    stop, errors, ledger = threading.Event(), [], Ledger()
    threads: list[threading.Thread] = []
    try:
        settings = {
            "name": "servefaults", "kafka": {"bootstrap_servers": broker.bootstrap_servers},
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"sampling": {"max_tokens": 6, "temperature": 1.0}, "metrics_port": None},
            "trainer": {"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_port": None},
            "serve": {"api_key": KEY, "model_name": "tiny", "server_id": "faults", "sync_poll_s": 0.5,
                      "feedback_timeout_s": 15, "batch_window_ms": 20}}
        config_file = tmp_path / "serve.yaml"
        config_file.write_text(yaml.safe_dump(settings))
        server = Server(config_file, free_port(), tmp_path / "serve.log")
        server.start()
        threads = [threading.Thread(target=client, args=(i, server.base, ledger, stop, errors), daemon=True)
                   for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        wait_for_more(ledger, 20, 60, server)

        broker.kill_node(1)  # the broker dies under the load ...
        time.sleep(2)
        broker.start_node(1)  # ... and comes back on its address
        wait_for_more(ledger, 20, 120, server)
        before_kill = dict(ledger.acknowledged)

        server.kill()  # SIGKILL, with feedback just acknowledged and more being written
        server.start()
        wait_for_more(ledger, 20, 120, server)
        stop.set()
        for thread in threads:
            thread.join(60)

        # a feedback acknowledged by the killed server, sent again to the new one: answered from its receipt
        for key in list(before_kill)[-5:]:
            again = httpx.post(f"{server.base}/feedback", headers=HEADERS, timeout=30,
                               json={"response_id": key[0], "choice": key[1], "reward": ledger.rewards[key]})
            assert again.status_code == 200 and again.json()["eid"] == before_kill[key], again.text
    finally:
        stop.set()
        if server is not None:
            server.stop()

    try:
        config = load_config(overrides=settings, env={})
        clients = KafkaClients(config, broker.bootstrap_servers)
        experiences = read_all(config, broker.bootstrap_servers, "experiences", clients.serde, Experience, idle=2)
        clients.close()
    finally:
        broker.stop()
    assert not errors, errors[:5]
    eids = [e.eid for e in experiences]
    assert len(eids) == len(set(eids)), "an experience was written twice"
    written = {tuple(e.eid.rsplit("/", 1)) for e in experiences}
    acknowledged = {(rid, str(choice)) for rid, choice in ledger.acknowledged}
    assert written == acknowledged, (f"{len(written - acknowledged)} written but never acknowledged, "
                                     f"{len(acknowledged - written)} acknowledged but not written")
    assert {e.eid: e.reward for e in experiences} == {
        f"{rid}/{choice}": reward for (rid, choice), reward in ledger.rewards.items()}
    # the faults really happened under load, and the retries were exercised
    assert server.lifetimes == 2 and ledger.replayed >= 3, (server.lifetimes, ledger.replayed)
    assert len(ledger.acknowledged) >= 60
