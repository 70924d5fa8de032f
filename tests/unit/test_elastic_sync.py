"""Elastic weight-sync groups over gloo with real receiver processes (no broker): members join and leave
between syncs, a receiver killed in the middle of a broadcast or frozen (SIGSTOP) holds the sender up for at
most its timeout, and every live receiver ends with the newest version, bit for bit."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from streamrft.engines.weights.broadcast_digest import check_weights_digest, weights_digest
from streamrft.engines.weights.elastic import ElasticMember, ElasticSender
from streamrft.engines.weights.errors import BroadcastIntegrityError
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal

TIMEOUT_S = 6.0
BUCKET = 1 << 20


def version_weights(version: int, mb: int = 4) -> dict[str, torch.Tensor]:
    """``mb`` tensors of 1 MiB: one bucket each, so a receiver can die between buckets."""
    g = torch.Generator().manual_seed(version)
    return {f"layer{i}.weight": torch.randn(BUCKET // 4, generator=g) for i in range(mb)}


def receive(address: str, session: str, member: str, out: str, die_in: int, stop, timeout_s: float,
            secret: bytes | None = None) -> None:
    """Child process: a CollectiveReceiver; saves every version it is handed; with ``die_in`` it SIGKILLs itself
    after the first bucket of that version."""
    from streamrft.engines.weights import collective
    from streamrft.weights.receiver import CollectiveReceiver

    if die_in:
        whole = collective.ReceivedWeights.__iter__

        def dying(self):
            for i, item in enumerate(whole(self)):
                if self.version == die_in and i == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item
        collective.ReceivedWeights.__iter__ = dying
    ready = SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE, uri=address,
                       state=json.dumps({"session": session, "receivers": 1, "backend": "gloo"}), lineage="x")
    receiver = CollectiveReceiver(ready, member=member, host="127.0.0.1", timeout_s=timeout_s,
                                  secret=secret).start()
    version = 0
    while not stop.is_set():
        got = receiver.wait(version + 1, timeout=0.2, epoch=receiver.epoch)
        if got is None:
            time.sleep(0.05)
            continue
        version = got[0]
        torch.save(got[1], Path(out) / f"{member}-v{version}.pt")
    receiver.close(timeout=10)


class Receivers:
    def __init__(self, sender: ElasticSender, out: Path) -> None:
        self.sender = sender
        self.out = out
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, tuple] = {}

    def start(self, member: str, die_in: int = 0, secret: bytes | None = None) -> None:
        stop = self.ctx.Event()
        proc = self.ctx.Process(target=receive, args=(self.sender.address, self.sender.session, member,
                                                      str(self.out), die_in, stop, self.sender.timeout_s, secret),
                                daemon=True)
        proc.start()
        self.procs[member] = (proc, stop)

    def stop(self, member: str) -> None:
        proc, stop = self.procs[member]
        stop.set()
        proc.join(30)
        assert proc.exitcode == 0, f"{member} exited {proc.exitcode}"

    def close(self) -> None:
        for proc, stop in self.procs.values():
            stop.set()
        for proc, _ in self.procs.values():
            proc.join(15)
            if proc.is_alive():
                proc.kill()

    def received(self, member: str, version: int, wait_s: float = 30) -> dict[str, torch.Tensor]:
        path = self.out / f"{member}-v{version}.pt"
        deadline = time.monotonic() + wait_s
        while not path.exists():
            assert time.monotonic() < deadline, f"{member} never got v{version}"
            time.sleep(0.1)
        time.sleep(0.2)  # written whole
        return torch.load(path, weights_only=True)


def members_of(delivery) -> set[str]:
    return {m.partition("/")[0] for m in delivery.receivers}


def assert_same(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(sent)
    for name, tensor in sent.items():
        assert torch.equal(got[name], tensor), name


def wait_registered(sender: ElasticSender, count: int) -> None:
    assert sender.wait_for(count, 90) == count, f"{count} receivers never registered"


@pytest.fixture
def elastic(request, tmp_path: Path):
    # the membership test times nothing: a generous timeout, so a loaded machine never leaves a member out
    timeout_s = getattr(request, "param", TIMEOUT_S)
    sender = ElasticSender("127.0.0.1", "ab12cd34ef56", timeout_s=timeout_s)
    receivers = Receivers(sender, tmp_path)
    yield sender, receivers
    sender.close()
    receivers.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("elastic", [30.0], indirect=True, ids=["timeout-30s"])
def test_members_join_and_leave_between_syncs_and_each_epoch_reaches_the_live_ones(elastic):
    sender, receivers = elastic
    receivers.start("a")
    receivers.start("b")
    wait_registered(sender, 2)
    first = sender.broadcast(version_weights(1).items(), 1, bucket_bytes=BUCKET)
    assert (first.epoch, members_of(first), first.failure) == (1, {"a", "b"}, "")
    # the digest the trainer announces is of what it sent, and what a receiver got whole verifies against it
    assert first.stats.digest == weights_digest(version_weights(1).items())
    check_weights_digest(receivers.received("a", 1), first.stats.digest, 1)
    again = sender.broadcast(version_weights(2).items(), 2, bucket_bytes=BUCKET)
    assert again.epoch == 1  # nobody came or went: the same group
    receivers.start("c")
    wait_registered(sender, 3)
    third = sender.broadcast(version_weights(3).items(), 3, bucket_bytes=BUCKET)
    assert (third.epoch, members_of(third)) == (2, {"a", "b", "c"})
    assert_same(receivers.received("b", 3), version_weights(3))  # saved before b is asked to stop
    receivers.stop("b")
    fourth = sender.broadcast(version_weights(4).items(), 4, bucket_bytes=BUCKET)
    assert (fourth.epoch, members_of(fourth)) == (3, {"a", "c"})
    for member, last in (("a", 4), ("b", 3), ("c", 4)):
        assert_same(receivers.received(member, last), version_weights(last))
    for path in receivers.out.glob("*.pt"):  # whatever else a receiver was handed (it keeps the newest only)
        assert_same(torch.load(path, weights_only=True), version_weights(int(path.stem.rpartition("-v")[2])))


@pytest.mark.timeout(240)
def test_a_receiver_killed_mid_broadcast_holds_the_sender_up_no_longer_than_its_timeout(elastic):
    sender, receivers = elastic
    receivers.start("a")
    receivers.start("b", die_in=2)
    wait_registered(sender, 2)
    assert members_of(sender.broadcast(version_weights(1).items(), 1, bucket_bytes=BUCKET)) == {"a", "b"}
    started = time.monotonic()
    broken = sender.broadcast(version_weights(2).items(), 2, bucket_bytes=BUCKET)
    assert time.monotonic() - started < TIMEOUT_S + 2
    receivers.procs["b"][0].join(10)
    assert receivers.procs["b"][0].exitcode == -signal.SIGKILL
    receivers.start("c")
    deadline = time.monotonic() + 90
    while sender.events() < 4:  # a and b joined; then a again (its group broke) and c
        assert time.monotonic() < deadline, "a and c did not register"
        time.sleep(0.1)
    started = time.monotonic()
    latest = sender.broadcast(version_weights(3).items(), 3, bucket_bytes=BUCKET)
    # the dead member is left out after at most one timeout, whoever noticed it first
    assert time.monotonic() - started < TIMEOUT_S + 2
    assert members_of(latest) == {"a", "c"} and latest.failure == ""
    assert latest.epoch > broken.epoch
    for member in ("a", "c"):
        assert_same(receivers.received(member, 3), version_weights(3))


@pytest.mark.timeout(240)
def test_a_frozen_receiver_is_left_out_after_the_timeout(elastic):
    sender, receivers = elastic
    receivers.start("a")
    receivers.start("b")
    wait_registered(sender, 2)
    sender.broadcast(version_weights(1).items(), 1, bucket_bytes=BUCKET)
    frozen = receivers.procs["b"][0]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # 32 MiB: more than loopback socket buffers hold, so the sender must wait for the frozen one
        stuck = sender.broadcast(version_weights(2, mb=32).items(), 2, bucket_bytes=BUCKET)
        waited = time.monotonic() - started
        assert stuck.failure and waited < TIMEOUT_S * 1.5 + 2, (stuck, waited)
        started = time.monotonic()
        latest = sender.broadcast(version_weights(3).items(), 3, bucket_bytes=BUCKET)
        assert time.monotonic() - started < TIMEOUT_S + 2
        assert members_of(latest) == {"a"}
        assert_same(receivers.received("a", 3), version_weights(3))
    finally:
        os.kill(frozen.pid, signal.SIGKILL)


SECRET = b"run-secret-0123456789"


def test_received_bytes_that_are_not_what_was_announced_are_refused():
    sent = version_weights(1, mb=1)
    digest = weights_digest(sent.items())
    check_weights_digest({k: v.clone() for k, v in sent.items()}, digest, 1)
    changed = {k: v.clone() for k, v in sent.items()}
    changed["layer0.weight"][7] += 1e-3
    renamed = {"layer1.weight": sent["layer0.weight"]}
    retyped = {"layer0.weight": sent["layer0.weight"].to(torch.float64)}
    for received in (changed, renamed, retyped):
        with pytest.raises(BroadcastIntegrityError, match="BLAKE3"):
            check_weights_digest(received, digest, 1)
    with pytest.raises(BroadcastIntegrityError, match="no digest"):
        check_weights_digest(sent, "", 1)


def test_a_member_without_the_run_secret_is_not_admitted_and_a_copied_token_is_worth_nothing():
    sender = ElasticSender("127.0.0.1", "ab12cd34ef56", timeout_s=TIMEOUT_S, secret=SECRET)
    try:
        def member(name: str, secret: bytes | None) -> ElasticMember:
            return ElasticMember(sender.address, sender.session, name, host="127.0.0.1", timeout_s=TIMEOUT_S,
                                 secret=secret)
        member("right", SECRET).register()
        member("wrong", b"another-secret-0123").register()
        member("none", None).register()
        assert sender.registered() == 1
        # a process that reads the store copies right's entry to a new index: it does not verify there
        forger = member("forger", None)
        entry = forger._store.get(forger._key("log/1"))
        index = int(forger._store.add(forger._key("log/n"), 1))
        forger._store.set(forger._key(f"log/{index}"), entry)
        forger._store.set(forger._key(f"log/{index + 1}"), json.dumps(
            {**json.loads(entry), "member": "forger"}))
        forger._store.add(forger._key("log/n"), 1)
        assert sender.registered() == 1
        log = sender._read_log()
        assert log.joined == ["right"]
    finally:
        sender.close()


def test_without_a_secret_membership_is_open_as_before():
    sender = ElasticSender("127.0.0.1", "ab12cd34ef56", timeout_s=TIMEOUT_S)
    try:
        ElasticMember(sender.address, sender.session, "any", host="127.0.0.1", timeout_s=TIMEOUT_S).register()
        assert sender.registered() == 1
    finally:
        sender.close()


@pytest.mark.timeout(240)
def test_with_a_secret_only_the_members_that_hold_it_receive_the_weights(tmp_path: Path):
    sender = ElasticSender("127.0.0.1", "ab12cd34ef56", timeout_s=30.0, secret=SECRET)
    receivers = Receivers(sender, tmp_path)
    try:
        receivers.start("a", secret=SECRET)
        receivers.start("b", secret=b"another-secret-0123")
        deadline = time.monotonic() + 90
        while sender.events() < 2:
            assert time.monotonic() < deadline, "a and b never wrote to the membership log"
            time.sleep(0.1)
        wait_registered(sender, 1)
        delivery = sender.broadcast(version_weights(1).items(), 1, bucket_bytes=BUCKET)
        assert members_of(delivery) == {"a"} and delivery.failure == ""
        got = receivers.received("a", 1)
        assert_same(got, version_weights(1))
        check_weights_digest(got, delivery.stats.digest, 1)
        assert not list(tmp_path.glob("b-*.pt"))
    finally:
        sender.close()
        receivers.close()
