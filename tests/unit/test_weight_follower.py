"""WeightFollower: which weight signals a rollout worker follows, and that nothing it is sent can stop it or
change the weights it serves unless it is this run's, verified, and fits the engine. No broker: signals are
built by hand and a stand-in SyncView holds them."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from streamrft.config import load_config
from streamrft.engines.inference import create_engine
from streamrft.engines.weights.broadcast_digest import weights_digest
from streamrft.engines.weights.object_store import ObjectStore
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal
from streamrft.sync import supersedes
from streamrft.weights.follower import WeightFollower

LOST, RESUMED = "20250101T000000-aaaa", "20250101T010000-bbbb"


def weights(seed: int, size: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(size, size, generator=g), "b": torch.randn(size, generator=g)}


class View:
    """What the follower reads of a SyncView; ``later`` signals arrive one per poll, applied as SyncView does
    (with ``supersedes``)."""

    def __init__(self, *later: SyncSignal) -> None:
        self.weights: SyncSignal | None = None
        self.collective_ready: SyncSignal | None = None
        self.later = list(later)
        self.polls = 0

    def apply(self, signal: SyncSignal) -> "View":
        if signal.kind == SyncKind.NCCL_READY:
            self.collective_ready = signal
        elif supersedes(self.weights, signal):
            self.weights = signal
        return self

    def poll(self, timeout: float = 0.0) -> list[SyncSignal]:
        self.polls += 1
        if self.later:
            signal = self.later.pop(0)
            self.apply(signal)
            return [signal]
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "weights"


def make_config(store_dir: Path, method: str = "object_store"):
    return load_config(overrides={"name": "t-follow", "trainer": {"weights": {"url": store_dir.as_uri(),
                                                                              "method": method}}}, env={})


def make_follower(store_dir: Path, method: str = "object_store", engine=None, **kwargs):
    engine = engine or create_engine("fake")
    engine.load_weights(weights(0), version=0)  # the weights it was built with (shapes to compare against)
    registry = CollectorRegistry()
    kwargs.setdefault("clock", Clock())
    return WeightFollower(make_config(store_dir, method), engine, "w0", registry, **kwargs), engine, registry


def publish(store_dir: Path, version: int, lineage: str = LOST, tensors=None) -> SyncSignal:
    published = ObjectStore(store_dir.as_uri(), lineage=lineage, keep_last=10).publish(
        (tensors or weights(version)).items(), version=version)
    return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.OBJECT_STORE,
                      uri=published.uri, sha256=published.sha256, nbytes=published.nbytes, source="trainer",
                      lineage=lineage)


def signal_like(signal: SyncSignal, **changes) -> SyncSignal:
    fields = {k: getattr(signal, k) for k in ("kind", "version", "method", "uri", "sha256", "nbytes", "source",
                                              "lineage")}
    return SyncSignal(**(fields | changes))


def assert_serves(engine, expected: dict[str, torch.Tensor], version: int) -> None:
    assert engine.version == version
    served = engine.state_dict()
    assert set(served) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(served[name], tensor), name


def refused_count(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("streamrft_rollout_weights_refused_total", {"reason": reason}) or 0.0


# ----------------------------------------------------------------------------- the rule
def test_supersedes_another_lineage_whatever_its_version_and_only_higher_within_one():
    at = lambda version, lineage: SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, lineage=lineage)
    assert supersedes(None, at(0, ""))
    assert supersedes(at(7, LOST), at(3, RESUMED))
    assert supersedes(at(7, LOST), at(8, LOST))
    assert not supersedes(at(7, LOST), at(7, LOST))
    assert not supersedes(at(7, LOST), at(6, LOST))
    assert supersedes(at(2, ""), at(1, LOST))  # a writer without lineages, then one with


# ----------------------------------------------------------------------------- following
def test_follows_a_published_version_and_reports_nothing(store_dir: Path):
    follower, engine, registry = make_follower(store_dir)
    view = View().apply(publish(store_dir, 1))
    assert follower.swap_to_latest(view)
    assert_serves(engine, weights(1), 1)
    assert follower.loaded.lineage == LOST and follower.take_refusals() == []
    assert registry.get_sample_value("streamrft_rollout_model_version") == 1
    assert not follower.swap_to_latest(view)  # nothing new


def test_a_resumed_trainer_is_followed_to_a_lower_version(store_dir: Path):
    follower, engine, _ = make_follower(store_dir)
    view = View().apply(publish(store_dir, 5, LOST))
    assert follower.swap_to_latest(view) and engine.version == 5
    view.apply(publish(store_dir, 4, LOST))  # an older signal of the same lineage: not followed
    assert view.weights.version == 5 and not follower.swap_to_latest(view)
    view.apply(publish(store_dir, 2, RESUMED))
    assert follower.swap_to_latest(view)
    assert_serves(engine, weights(2), 2)
    assert follower.loaded.lineage == RESUMED
    assert follower.serves(2, view)


def _escaping_shard(store_dir: Path, good: SyncSignal) -> SyncSignal:
    """A manifest (in the right place, with its sha256 announced) whose shard file points into another version."""
    bad = publish(store_dir, 2)
    path = Path(bad.uri.removeprefix("file://"))
    doc = json.loads(path.read_text())
    doc["shards"][0]["file"] = f"../{Path(good.uri).parent.name}/{doc['shards'][0]['file']}"
    path.write_text(json.dumps(doc))
    return signal_like(bad, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def _copied_version(store_dir: Path, good: SyncSignal) -> SyncSignal:
    """v1's files copied under v3's name: the URI and sha256 check out, the manifest says version 1."""
    source = Path(good.uri.removeprefix("file://")).parent
    shutil.copytree(source, source.with_name(f"v00000003-{LOST}"))
    return signal_like(good, version=3, uri=good.uri.replace("v00000001", "v00000003"))


def _other_shapes(store_dir: Path, good: SyncSignal) -> SyncSignal:
    return publish(store_dir, 2, tensors=weights(2, size=5))


def _corrupted_shard(store_dir: Path, good: SyncSignal) -> SyncSignal:
    bad = publish(store_dir, 2)
    shard = next(Path(bad.uri.removeprefix("file://")).parent.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return bad


def _elsewhere(store_dir: Path, good: SyncSignal) -> SyncSignal:
    return publish(store_dir.parent / "elsewhere", 2)


FORGED = {
    "foreign URI": (_elsewhere, "foreign-uri"),
    "other protocol": (lambda d, g: signal_like(g, version=2, uri="http://evil.example/v00000002/manifest.json"),
                       "foreign-uri"),
    "memory protocol": (lambda d, g: signal_like(g, version=2, uri=g.uri.replace("file://", "memory://")), "foreign-uri"),
    ".. in the URI": (lambda d, g: signal_like(g, version=2, uri=g.uri.replace("/v00000001-", "/../weights/v00000001-")),
                      "foreign-uri"),
    ".. in a shard name": (_escaping_shard, "unsafe-shard-name"),
    "empty sha256": (lambda d, g: signal_like(g, version=2, sha256=""), "missing-sha256"),
    "manifest version != signal version": (_copied_version, "version-mismatch"),
    "wrong method": (lambda d, g: signal_like(g, version=2, method=SyncMethod.COLLECTIVE), "wrong-method"),
    "huge version": (lambda d, g: signal_like(g, version=2 ** 62), "foreign-uri"),
    "lineage that is not a name": (lambda d, g: signal_like(g, version=2, lineage="../x"), "bad-signal"),
    "shapes the engine refuses": (_other_shapes, "incompatible-weights"),
    "corrupted shard": (_corrupted_shard, "integrity"),
}


@pytest.mark.parametrize("forge", FORGED.values(), ids=list(FORGED))
def test_forged_signals_are_refused_and_the_engine_keeps_its_weights(store_dir: Path, forge):
    make, reason = forge
    follower, engine, registry = make_follower(store_dir)
    good = publish(store_dir, 1)
    assert follower.swap_to_latest(View().apply(good))
    forged = make(store_dir, good)
    view = View().apply(forged)
    assert supersedes(good, forged)  # each would be followed if it were trusted
    assert not follower.swap_to_latest(view)
    (refusal,) = follower.take_refusals()
    assert (refusal.reason, refusal.transient, refusal.signal) == (reason, False, forged)
    assert refused_count(registry, reason) == 1
    assert_serves(engine, weights(1), 1)
    assert not follower.swap_to_latest(view) and follower.take_refusals() == []  # not retried, not re-reported
    # and the worker goes on: the next real version is loaded
    view.weights = publish(store_dir, 7)
    assert follower.swap_to_latest(view)
    assert_serves(engine, weights(7), 7)


def test_follow_refuses_a_forged_signal_as_soon_as_it_is_announced(store_dir: Path):
    follower, engine, _ = make_follower(store_dir)
    forged = signal_like(publish(store_dir, 1), sha256="")
    follower.follow(View().apply(forged))
    assert [r.reason for r in follower.take_refusals()] == ["missing-sha256"]
    assert engine.version == 0


class _Raising:
    """An engine whose load fails after its checks pass (as a failing device copy would)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.inner = create_engine("fake")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    def load_weights(self, tensors, version: int) -> None:
        if version > 0:
            raise self.error
        self.inner.load_weights(tensors, version)


@pytest.mark.parametrize("error, reason", [(ValueError("shape mismatch: w"), "incompatible-weights"),
                                           (RuntimeError("CUDA out of memory"), "engine-error"),
                                           (KeyError("w"), "engine-error"),
                                           (OverflowError("too big"), "engine-error")])
def test_an_engine_that_raises_while_loading_is_a_refusal(store_dir: Path, error, reason):
    follower, engine, _ = make_follower(store_dir, engine=_Raising(error))
    assert not follower.swap_to_latest(View().apply(publish(store_dir, 1)))
    assert [r.reason for r in follower.take_refusals()] == [reason]
    assert engine.version == 0 and follower.loaded is None


def test_manifest_errors_of_any_type_are_refusals(store_dir: Path, monkeypatch):
    """ImportError (an fsspec backend missing), AttributeError, ...: whatever reading raises, never a crash."""
    import streamrft.weights.follower as module

    follower, engine, _ = make_follower(store_dir)
    view = View()
    for version, (error, reason) in enumerate([(ImportError("no module named s3fs"), "store-unavailable"),
                                               (AttributeError("'list' object has no attribute 'get'"),
                                                "load-error")], start=1):
        monkeypatch.setattr(module, "read_manifest", lambda *a, error=error, **k: (_ for _ in ()).throw(error))
        view.apply(publish(store_dir, version))
        assert not follower.swap_to_latest(view)
        assert [r.reason for r in follower.take_refusals()] == [reason]
    assert engine.version == 0


# ----------------------------------------------------------------------------- retries
def test_an_unreachable_store_is_retried_with_backoff_and_then_loaded(store_dir: Path):
    clock = Clock()
    follower, engine, registry = make_follower(store_dir, clock=clock)
    signal = publish(store_dir, 1)
    version_dir = Path(signal.uri.removeprefix("file://")).parent
    hidden = version_dir.rename(version_dir.with_name("not-yet-visible"))  # announced before it is readable
    view = View().apply(signal)
    assert not follower.swap_to_latest(view)
    (refusal,) = follower.take_refusals()
    assert (refusal.reason, refusal.transient) == ("unreachable", True)
    clock.now += 0.5
    assert not follower.swap_to_latest(view)  # backoff: 1 s before the second attempt
    assert refused_count(registry, "unreachable") == 1
    clock.now += 1.0
    assert not follower.swap_to_latest(view)  # second attempt, then 2 s
    assert refused_count(registry, "unreachable") == 2 and follower.take_refusals() == []  # reported once
    hidden.rename(version_dir)
    clock.now += 2.0
    assert follower.swap_to_latest(view)
    assert_serves(engine, weights(1), 1)


def test_retries_are_bounded_and_then_final(store_dir: Path):
    clock = Clock()
    follower, engine, _ = make_follower(store_dir, clock=clock, retry_attempts=3)
    signal = signal_like(publish(store_dir, 1), version=2, uri=publish(store_dir, 1).uri.replace("v00000001",
                                                                                               "v00000002"))
    view = View().apply(signal)
    for _ in range(3):
        follower.swap_to_latest(view)
        clock.now += 60
    refusals = follower.take_refusals()
    assert [(r.reason, r.transient) for r in refusals] == [("unreachable", True), ("unreachable", False)]
    assert "gave up after 3 attempts" in refusals[-1].detail
    assert not follower.swap_to_latest(view) and engine.version == 0


# ----------------------------------------------------------------------------- a version a request needs
def test_a_version_needed_is_served_once_loaded_and_one_refused_is_said_so(store_dir: Path):
    follower, engine, _ = make_follower(store_dir)
    view = View().apply(publish(store_dir, 1))
    assert not follower.serves(1, view) and follower.newer_due(view) and not follower.refused(1, view)
    assert follower.swap_to_latest(view) and follower.serves(1, view) and engine.version == 1
    assert follower.serves(0, View())  # the built-in weights do for 0
    refused = View().apply(signal_like(publish(store_dir, 2), sha256=""))
    assert not follower.swap_to_latest(refused) and not follower.newer_due(refused)
    assert follower.refused(2, refused)  # a request that needs v2 waits in vain
    assert not follower.refused(3, refused)  # v3 may still come
    assert refused.polls == 0 and engine.version == 1


# ----------------------------------------------------------------------------- collective
class FakeReceiver:
    """Stands in for CollectiveReceiver: ``tensors`` is what it received; ``broken`` the epochs whose group broke
    before it received their version."""
    started: list["FakeReceiver"] = []

    def __init__(self, ready: SyncSignal, *, member: str, host: str, group_port: int, device,
                 timeout_s: float, secret: bytes | None) -> None:
        self.ready = ready
        self.secret = secret
        self.member = f"{member}/0001"
        self.device = device
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.broken: set[int] = set()
        self.closed = False

    def start(self) -> "FakeReceiver":
        FakeReceiver.started.append(self)
        return self

    def wait(self, version: int, timeout: float, *, epoch: int):
        if epoch in self.broken or version not in self.tensors:
            return None
        return version, self.tensors[version]

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True


def announcement(host: str = "127.0.0.1", lineage: str = LOST, **state) -> SyncSignal:
    state = {"session": "ab12cd34ef56", "receivers": 1, "bucket_bytes": 1 << 20, "backend": "gloo", **state}
    return SyncSignal(kind=SyncKind.NCCL_READY, version=0, method=SyncMethod.COLLECTIVE,
                      uri=f"tcp://{host}:29501", state=json.dumps(state), lineage=lineage)


def broadcast_signal(version: int, lineage: str = LOST, *, receivers=("w0/0001",), epoch: int = 1,
                     catch_up: SyncSignal | None = None, sent: dict[str, torch.Tensor] | None = None) -> SyncSignal:
    """A collective WEIGHTS_PUBLISHED; ``catch_up``: the object-store signal of its catch-up copy; ``sent``: the
    tensors the trainer broadcast (their digest is announced; ``weights(version)`` unless given)."""
    digest = weights_digest((weights(version) if sent is None else sent).items())
    state = {"epoch": epoch, "receivers": list(receivers), "catch_up": catch_up.uri if catch_up else "",
             "digest": digest}
    return SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.COLLECTIVE,
                      uri="tcp://127.0.0.1:29501", lineage=lineage, state=json.dumps(state),
                      sha256=catch_up.sha256 if catch_up else "")


def test_an_announcement_is_not_joined_in_an_object_store_run(store_dir: Path):
    FakeReceiver.started.clear()
    follower, _, _ = make_follower(store_dir, receiver_factory=FakeReceiver)
    view = View().apply(announcement())
    follower.follow(view)
    follower.follow(view)
    assert FakeReceiver.started == []
    assert [r.reason for r in follower.take_refusals()] == ["wrong-method"]  # once per announcement


@pytest.mark.parametrize("ready", [announcement(host="10.9.8.7"), announcement(receivers="2"),
                                   announcement(session="x; rm"), announcement(backend="mpi"),
                                   signal_like(announcement(), kind=SyncKind.NCCL_READY, lineage="a/b")],
                         ids=["store elsewhere", "receivers", "session", "backend", "lineage"])
def test_a_forged_announcement_is_not_joined(store_dir: Path, ready):
    FakeReceiver.started.clear()
    follower, _, _ = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    follower.follow(View().apply(ready))
    assert FakeReceiver.started == []
    assert [r.reason for r in follower.take_refusals()] == ["bad-announcement"]


def test_the_receiver_follows_the_backend_the_trainer_announces(store_dir: Path):
    """The trainer's device decides the backend; a worker never guesses it from its own device."""
    FakeReceiver.started.clear()
    follower, _, _ = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    follower.follow(View().apply(announcement(backend="gloo")))
    assert [r.device.type for r in FakeReceiver.started] == ["cpu"]
    follower.follow(View().apply(announcement(backend="nccl", session="0123456789ab")))
    if torch.cuda.is_available():
        assert FakeReceiver.started[-1].device.type == "cuda"
    else:  # a CPU worker cannot meet a CUDA trainer's NCCL group: refused with what to do, not joined
        assert len(FakeReceiver.started) == 1
        (refusal,) = follower.take_refusals()
        assert refusal.reason == "backend-unavailable" and "object_store" in refusal.detail


def test_broadcast_weights_are_loaded_from_the_joined_group_of_their_lineage(store_dir: Path):
    FakeReceiver.started.clear()
    clock = Clock()
    follower, engine, _ = make_follower(store_dir, "collective", receiver_factory=FakeReceiver, clock=clock)
    view = View().apply(announcement())
    follower.follow(view)
    (receiver,) = FakeReceiver.started
    receiver.tensors[1] = weights(1)
    assert follower.swap_to_latest(view.apply(broadcast_signal(1)))
    assert_serves(engine, weights(1), 1)
    # a resumed trainer's signal before its announcement is followed: not the old group's, retried
    view.apply(broadcast_signal(1, RESUMED, sent=weights(11)))
    assert not follower.swap_to_latest(view)
    assert [(r.reason, r.transient) for r in follower.take_refusals()] == [("no-group", True)]
    follower.follow(view.apply(announcement(lineage=RESUMED, session="0123456789ab")))
    FakeReceiver.started[-1].tensors[1] = weights(11)
    clock.now += 1
    assert follower.swap_to_latest(view)
    assert_serves(engine, weights(11), 1)
    assert follower.loaded.lineage == RESUMED


def test_a_version_this_worker_missed_by_broadcast_is_caught_up_from_the_object_store(store_dir: Path):
    """Not among the receivers (joined late), or among them but its group broke: the catch-up copy, verified
    like any object-store version; a worker never waits for a broadcast it cannot get."""
    FakeReceiver.started.clear()
    follower, engine, registry = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    view = View().apply(announcement())
    follower.follow(view)
    (receiver,) = FakeReceiver.started
    late = broadcast_signal(1, receivers=("w1/0001",), catch_up=publish(store_dir, 1))
    assert follower.swap_to_latest(view.apply(late))
    assert_serves(engine, weights(1), 1)
    receiver.broken.add(2)
    receiver.tensors[2] = weights(99)  # what a broken group left half-received: never served
    assert follower.swap_to_latest(view.apply(broadcast_signal(2, epoch=2, catch_up=publish(store_dir, 2))))
    assert_serves(engine, weights(2), 2)
    receiver.tensors[3] = weights(3)  # received whole: the broadcast copy, the store is not read
    copy = publish(store_dir, 3)
    shutil.rmtree(Path(copy.uri.removeprefix("file://")).parent)
    assert follower.swap_to_latest(view.apply(broadcast_signal(3, epoch=3, catch_up=copy)))
    assert_serves(engine, weights(3), 3)
    assert registry.get_sample_value("streamrft_rollout_weights_caught_up_total") == 2
    assert follower.take_refusals() == []


def test_a_missed_broadcast_without_a_catch_up_copy_or_from_elsewhere_is_refused(store_dir: Path):
    FakeReceiver.started.clear()
    follower, engine, _ = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    view = View().apply(announcement())
    follower.follow(view)
    assert not follower.swap_to_latest(view.apply(broadcast_signal(1, receivers=())))
    foreign = publish(store_dir.parent / "elsewhere", 2)
    assert not follower.swap_to_latest(view.apply(broadcast_signal(2, receivers=(), catch_up=foreign)))
    assert [r.reason for r in follower.take_refusals()] == ["missed-broadcast", "foreign-uri"]
    assert engine.version == 0


def tampered(version: int) -> dict[str, torch.Tensor]:
    """``weights(version)`` with one element changed: what a member that is not the trainer could send."""
    changed = {name: tensor.clone() for name, tensor in weights(version).items()}
    first = next(iter(changed.values()))
    first.view(-1)[0] += 1
    return changed


def test_a_tampered_broadcast_is_refused_and_the_catch_up_copy_is_loaded(store_dir: Path):
    FakeReceiver.started.clear()
    follower, engine, registry = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    view = View().apply(announcement())
    follower.follow(view)
    (receiver,) = FakeReceiver.started
    receiver.tensors[1] = tampered(1)
    assert follower.swap_to_latest(view.apply(broadcast_signal(1, catch_up=publish(store_dir, 1))))
    assert_serves(engine, weights(1), 1)  # the store's copy, never the tampered bytes
    assert registry.get_sample_value("streamrft_rollout_weights_refused_total",
                                     {"reason": "broadcast-integrity"}) == 1
    assert registry.get_sample_value("streamrft_rollout_weights_caught_up_total") == 1


def test_a_tampered_broadcast_without_a_catch_up_copy_is_refused_and_the_engine_keeps_its_weights(
        store_dir: Path):
    FakeReceiver.started.clear()
    follower, engine, _ = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    view = View().apply(announcement())
    follower.follow(view)
    (receiver,) = FakeReceiver.started
    receiver.tensors[1] = tampered(1)
    assert not follower.swap_to_latest(view.apply(broadcast_signal(1)))
    (refusal,) = follower.take_refusals()
    assert refusal.reason == "broadcast-integrity" and not refusal.transient and "BLAKE3" in refusal.detail
    assert engine.version == 0
    receiver.tensors[2] = weights(2)  # the next version, whole: followed
    assert follower.swap_to_latest(view.apply(broadcast_signal(2)))
    assert_serves(engine, weights(2), 2)


def test_a_broadcast_announced_without_a_digest_is_not_trusted(store_dir: Path):
    FakeReceiver.started.clear()
    follower, engine, _ = make_follower(store_dir, "collective", receiver_factory=FakeReceiver)
    view = View().apply(announcement())
    follower.follow(view)
    FakeReceiver.started[0].tensors[1] = weights(1)
    unsigned = broadcast_signal(1)
    unsigned = signal_like(unsigned, state=json.dumps({**json.loads(unsigned.state), "digest": ""}))
    assert not follower.swap_to_latest(view.apply(unsigned))
    assert [r.reason for r in follower.take_refusals()] == ["broadcast-integrity"]
    assert engine.version == 0
