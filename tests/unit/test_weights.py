"""Weight transports: object store round trip, integrity errors, retention; collective broadcast over gloo."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from streamrft.engines.weights import ManifestIntegrityError, ManifestMismatchError, ShardIntegrityError
from streamrft.engines.weights.collective import (
    CollectiveGroup,
    backend_for,
    broadcast_weights,
    free_port,
    receive_weights,
)
from streamrft.engines.weights.object_store import ObjectStore, iter_weights, load_weights, read_manifest


def sample_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(32, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.ones(16)),
        ("model.norm.weight", torch.randn(16, generator=g).half()),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("flags", torch.tensor([True, False, True])),
    ]


def assert_same(got: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert list(got) == [n for n, _ in expected]
    for name, t in expected:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


# ----------------------------------------------------------------------------- object store
def test_object_store_round_trip_is_identical(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri(), max_shard_bytes=1000)  # 3 shards; two tensors exceed the bound alone
    tensors = sample_tensors()
    uri, sha, nbytes = store.publish(tensors, version=3)
    assert uri == (tmp_path / "v00000003" / "manifest.json").as_uri()
    assert sha == hashlib.sha256((tmp_path / "v00000003" / "manifest.json").read_bytes()).hexdigest()
    manifest = read_manifest(uri, sha)
    assert manifest.version == 3 and len(manifest.shards) == 3
    assert nbytes == manifest.total_bytes == sum(f.stat().st_size for f in (tmp_path / "v00000003").glob("*.safetensors"))
    assert manifest.tensors["model.norm.weight"].dtype == "float16"
    assert manifest.tensors["model.embed_tokens.weight"].shape == (64, 16)
    assert_same(load_weights(uri, sha), tensors)
    assert_same(dict(iter_weights(uri, sha)), tensors)
    assert not list(tmp_path.rglob(".tmp-*")), "temporary files left behind"


def test_plain_directory_path_is_an_fsspec_url_too(tmp_path: Path):
    store = ObjectStore(str(tmp_path / "weights"))
    published = store.publish(sample_tensors(), version=0)
    assert published.uri.startswith("file://")
    assert_same(load_weights(published.uri, published.sha256), sample_tensors())


def test_shared_storage_tensors_are_published(tmp_path: Path):
    base = torch.randn(4, 4)
    tensors = [("a", base), ("tied", base), ("row", base[1])]
    pub = ObjectStore(tmp_path.as_uri()).publish(tensors, version=1)
    assert_same(load_weights(pub.uri, pub.sha256), tensors)


def _shards(tmp_path: Path, version: int) -> list[Path]:
    return sorted((tmp_path / f"v{version:08d}").glob("*.safetensors"))


def test_corrupted_shard_is_refused_naming_shard_and_hashes(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000)
    pub = store.publish(sample_tensors(), version=1)
    victim = _shards(tmp_path, 1)[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the tensor data
    victim.write_bytes(bytes(data))
    expected = json.loads((tmp_path / "v00000001" / "manifest.json").read_text())["shards"][1]["blake3"]
    with pytest.raises(ShardIntegrityError, match=f"{victim.name} is corrupted") as err:
        load_weights(pub.uri, pub.sha256)
    assert err.value.shard.endswith(victim.name)
    assert err.value.expected_digest == expected
    assert err.value.actual_digest == blake3.blake3(bytes(data)).hexdigest()
    assert expected in str(err.value) and err.value.actual_digest in str(err.value)


def test_truncated_shard_is_refused(tmp_path: Path):
    pub = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000).publish(sample_tensors(), version=1)
    victim = _shards(tmp_path, 1)[0]
    full = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: full // 2])
    with pytest.raises(ShardIntegrityError, match="truncated") as err:
        load_weights(pub.uri, pub.sha256)
    assert (err.value.expected_nbytes, err.value.actual_nbytes) == (full, full // 2)


def test_missing_shard_and_changed_manifest_are_refused(tmp_path: Path):
    pub = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000).publish(sample_tensors(), version=1)
    with pytest.raises(ManifestIntegrityError, match="expected 00"):
        load_weights(pub.uri, "00" * 32)
    _shards(tmp_path, 1)[-1].unlink()
    with pytest.raises(ShardIntegrityError, match="<missing>"):
        load_weights(pub.uri, pub.sha256)


def test_keeps_only_the_last_k_versions(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri(), keep_last=2)
    (tmp_path / "v00000000").mkdir()  # leftover of a crashed publish: no manifest
    (tmp_path / "v00000000" / ".tmp-x-model.safetensors").write_bytes(b"junk")
    published = [store.publish(sample_tensors(v), version=v) for v in range(1, 5)]
    assert store.versions() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004"]
    assert_same(load_weights(published[-1].uri, published[-1].sha256), sample_tensors(4))
    with pytest.raises(FileNotFoundError):
        load_weights(published[0].uri, published[0].sha256)


def test_republishing_a_version_replaces_it(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000)
    store.publish(sample_tensors(1), version=5)
    pub = store.publish(sample_tensors(2)[:2], version=5)
    assert_same(load_weights(pub.uri, pub.sha256), sample_tensors(2)[:2])
    assert len(_shards(tmp_path, 5)) == len(read_manifest(pub.uri, pub.sha256).shards)


# ----------------------------------------------------------------------------- collective
def _collective_worker(rank: int, port: int, world: int, out_dir: str) -> None:
    with CollectiveGroup.join(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=60) as group:
        for version in (1, 2):  # two syncs over the same group
            if rank == 0:
                broadcast_weights(group, sample_tensors(version), version, bucket_bytes=2048)
            else:
                # second sync: one reused staging buffer, so each tensor is copied before advancing
                received = receive_weights(group, reuse_buffer=version == 2)
                got = {name: t.clone() for name, t in received}
                # safetensors keeps dtype/shape exactly; the parent compares
                save_file(got, f"{out_dir}/rank{rank}-v{received.version}.safetensors")


@pytest.mark.timeout(120)
def test_collective_broadcast_over_gloo_gives_identical_tensors(tmp_path: Path):
    assert backend_for("cpu") == "gloo" and backend_for("cuda:0") == "nccl"
    world = 2  # trainer + one receiver (the code is the same for N)
    mp.spawn(_collective_worker, args=(free_port(), world, str(tmp_path)), nprocs=world, join=True)
    from safetensors.torch import load_file

    for rank in range(1, world):
        for version in (1, 2):
            got = load_file(tmp_path / f"rank{rank}-v{version}.safetensors")
            expected = sample_tensors(version)
            assert_same({n: got[n] for n, _ in expected}, expected)


def test_shards_are_standard_safetensors_both_ways(tmp_path: Path):
    """Our streaming writer's files load with the safetensors library, and our reader reads its files."""
    from safetensors.torch import load_file

    from streamrft.engines.weights.safetensors_io import read_safetensors

    tensors = dict(sample_tensors())
    pub = ObjectStore(tmp_path.as_uri()).publish(tensors.items(), version=1)
    shard = _shards(tmp_path, 1)[0]
    loaded = load_file(shard)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype
    assert read_manifest(pub.uri, pub.sha256).shards[0].file == shard.name

    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs, metadata={"k": "v"})
    buf = torch.frombuffer(bytearray(theirs.read_bytes()), dtype=torch.uint8)
    ours = read_safetensors(buf)
    for name, t in tensors.items():
        assert torch.equal(ours[name], t) and ours[name].dtype == t.dtype


# ----------------------------------------------------------------------------- lineages, trust
def test_lineages_do_not_overwrite_each_other_and_manifests_say_theirs(tmp_path: Path):
    lost = ObjectStore(tmp_path.as_uri(), lineage="20250101T000000-aaaa")
    resumed = ObjectStore(tmp_path.as_uri(), lineage="20250101T010000-bbbb")
    first = lost.publish(sample_tensors(1), version=3)
    second = resumed.publish(sample_tensors(2), version=3)
    assert first.uri != second.uri and first.uri.endswith("/v00000003-20250101T000000-aaaa/manifest.json")
    assert read_manifest(first.uri, first.sha256, expected_version=3,
                         expected_lineage="20250101T000000-aaaa").lineage == "20250101T000000-aaaa"
    assert_same(load_weights(first.uri, first.sha256), sample_tensors(1))
    assert_same(load_weights(second.uri, second.sha256, expected_lineage="20250101T010000-bbbb"), sample_tensors(2))
    with pytest.raises(ManifestMismatchError, match="lineage"):
        read_manifest(second.uri, second.sha256, expected_lineage="20250101T000000-aaaa")
    with pytest.raises(ManifestMismatchError, match="version 3, announced as v4"):
        load_weights(second.uri, second.sha256, expected_version=4)


def test_prune_keeps_the_newest_of_the_current_lineage_and_drops_older_lineages_first(tmp_path: Path):
    lost = ObjectStore(tmp_path.as_uri(), lineage="20250101T000000-aaaa", keep_last=2)
    for version in range(1, 6):
        lost.publish(sample_tensors(version), version=version)
    assert lost.versions() == [4, 5]
    resumed = ObjectStore(tmp_path.as_uri(), lineage="20250101T010000-bbbb", keep_last=2)
    fresh = resumed.publish(sample_tensors(9), version=3)  # lower than the lost v5: it must stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003-20250101T010000-bbbb",
                                                           "v00000005-20250101T000000-aaaa"]
    assert_same(load_weights(fresh.uri, fresh.sha256), sample_tensors(9))
    resumed.publish(sample_tensors(10), version=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003-20250101T010000-bbbb",
                                                           "v00000004-20250101T010000-bbbb"]
    # a leftover of the lost lifetime publishing late prunes only its own lineage, never the newer one's
    lost.publish(sample_tensors(11), version=6)
    assert resumed.versions() == [3, 4] and lost.versions() == [6]


def test_check_manifest_uri_accepts_only_the_announced_version_directory_of_the_store(tmp_path: Path):
    from streamrft.engines.weights import ForeignUriError, check_manifest_uri

    store = ObjectStore((tmp_path / "w").as_uri(), lineage="L1")
    pub = store.publish(sample_tensors(), version=2)
    base = (tmp_path / "w").as_uri()
    assert check_manifest_uri(base, pub.uri, 2, "L1") == pub.uri
    assert check_manifest_uri(str(tmp_path / "w"), pub.uri, 2, "L1") == pub.uri  # plain path = file://
    forged = {
        "another store": ((tmp_path / "other" / "v00000002-L1" / "manifest.json").as_uri(), "v2 of lineage"),
        "other protocol": ("memory://w/v00000002-L1/manifest.json", "protocol 'memory'"),
        "a protocol with no backend here": ("nosuchfs://x/v00000002-L1/manifest.json", "protocol 'nosuchfs'"),
        "..": (f"{base}/v00000002-L1/../v00000002-L1/manifest.json", "'..'"),
        "encoded ..": (f"{base}/v00000002-L1/%2e%2e/v00000002-L1/manifest.json", "'..'"),
        "a chain": (f"simplecache::{pub.uri}", "chain"),
        "another file of the version": (f"{base}/v00000002-L1/model-00001-of-00001.safetensors", "v2 of lineage"),
    }
    for uri, message in forged.values():
        with pytest.raises(ForeignUriError, match=message):
            check_manifest_uri(base, uri, 2, "L1")
    with pytest.raises(ForeignUriError):
        check_manifest_uri(base, pub.uri, 3, "L1")  # the signal's version must be the directory's
    with pytest.raises(ForeignUriError):
        check_manifest_uri(base, pub.uri, 2, "L2")


def _rewrite_manifest(manifest_path: Path, change) -> str:
    doc = json.loads(manifest_path.read_text())
    change(doc)
    body = json.dumps(doc).encode()
    manifest_path.write_bytes(body)
    return hashlib.sha256(body).hexdigest()


def test_manifests_that_escape_or_break_the_parser_are_weight_format_errors(tmp_path: Path):
    from streamrft.engines.weights import UnsafeShardNameError, WeightFormatError

    pub = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000).publish(sample_tensors(), version=1)
    path = tmp_path / "v00000001" / "manifest.json"
    original = path.read_text()
    for name in ("../v00000000/model-00001-of-00003.safetensors", "sub/model.safetensors", "..", ".hidden", ""):
        sha = _rewrite_manifest(path, lambda d: d["shards"][0].update(file=name))
        with pytest.raises(UnsafeShardNameError, match="not a plain file name"):
            load_weights(pub.uri, sha)
        path.write_text(original)
    not_an_object = b"[1, 2]"
    breakers = {
        "a list": not_an_object,
        "huge float version": lambda d: d.update(version=1e400),
        "bool version": lambda d: d.update(version=True),
        "negative nbytes": lambda d: d["shards"][0].update(nbytes=-1),
        "shape of strings": lambda d: d["tensors"]["flags"].update(shape=["x"]),
        "tensor in no shard": lambda d: d["tensors"].update(extra={"dtype": "float32", "shape": [1]}),
        "shard tensor not in the table": lambda d: d["tensors"].pop("flags"),
        "shards not a list": lambda d: d.update(shards=7),
    }
    for change in breakers.values():
        if isinstance(change, bytes):
            path.write_bytes(change)
            sha = hashlib.sha256(change).hexdigest()
        else:
            sha = _rewrite_manifest(path, change)
        with pytest.raises(WeightFormatError, match="manifest"):
            load_weights(pub.uri, sha)
        path.write_text(original)
    assert_same(load_weights(pub.uri, pub.sha256), sample_tensors())  # the original still loads


def test_reading_a_manifest_requires_its_sha256(tmp_path: Path):
    from streamrft.engines.weights import ChecksumRequiredError

    pub = ObjectStore(tmp_path.as_uri()).publish(sample_tensors(), version=1)
    for missing in ("", None, "abc", pub.sha256.upper()):
        with pytest.raises(ChecksumRequiredError, match="sha256 of 64 hex digits is required"):
            load_weights(pub.uri, missing)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) with a listening socket on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's socket table")
def test_rendezvous_stores_listen_on_the_configured_host_only():
    import datetime

    import torch.distributed as dist

    from streamrft.engines.weights.collective import listening_store

    store, port = listening_store("127.0.0.1", 0, timeout_s=10)
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 / ::
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    assert int(client.add("s/rank", 1)) == 1 and int(store.add("s/rank", 1)) == 2
    # what torch does on its own, which is why listening_store exists: every interface
    plain = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    assert _listening_addresses(plain.port) & {"00000000", "00000000000000000000000000000000"}


@pytest.mark.timeout(60)
def test_publishers_put_a_fresh_lineage_in_every_signal(tmp_path: Path):
    from streamrft.config import load_config
    from streamrft.engines.weights import check_lineage
    from streamrft.schemas import SyncKind
    from streamrft.weights.publishers import CollectivePublisher, ObjectStorePublisher
    from streamrft.weights.receiver import check_announcement

    class Engine:
        def named_weights(self):
            return sample_tensors()

        def publish_metadata(self):
            return {}

    config = load_config(overrides={"name": "t-lineage", "trainer": {"weights": {"url": tmp_path.as_uri()}}},
                         env={})
    first, resumed = ObjectStorePublisher(config, "trainer"), ObjectStorePublisher(config, "trainer")
    assert first.lineage != resumed.lineage and check_lineage(first.lineage) == first.lineage
    a, b = first.publish(Engine(), 2), resumed.publish(Engine(), 2)
    assert (a.lineage, b.lineage) == (first.lineage, resumed.lineage) and a.uri != b.uri
    assert_same(load_weights(a.uri, a.sha256, expected_version=2, expected_lineage=a.lineage), sample_tensors())

    collective = CollectivePublisher(config, torch.device("cpu"), "trainer")
    try:
        ready = collective.announcement()
        assert ready.kind == SyncKind.NCCL_READY and ready.lineage == collective.lineage != first.lineage
        state = check_announcement(ready, "127.0.0.1")
        assert state.session == collective.session and state.backend == "gloo"
        membership_port = int(ready.uri.rpartition(":")[2])
        assert _listening_addresses(membership_port) == {"0100007F"}
        with pytest.raises(ValueError, match="collective_host"):
            check_announcement(ready, "10.1.2.3")
    finally:
        collective.close()
