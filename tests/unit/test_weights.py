"""Weight transports: object store round trip, integrity errors, retention; collective broadcast over gloo."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from streamrft.engines.weights import (
    CollectiveGroup,
    ManifestIntegrityError,
    ObjectStore,
    ShardIntegrityError,
    backend_for,
    broadcast_weights,
    free_port,
    iter_weights,
    load_weights,
    read_manifest,
    receive_weights,
)


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
    assert_same(dict(iter_weights(uri)), tensors)
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
    assert_same(load_weights(pub.uri), tensors)


def _shards(tmp_path: Path, version: int) -> list[Path]:
    return sorted((tmp_path / f"v{version:08d}").glob("*.safetensors"))


def test_corrupted_shard_is_refused_naming_shard_and_hashes(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000)
    pub = store.publish(sample_tensors(), version=1)
    victim = _shards(tmp_path, 1)[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the tensor data
    victim.write_bytes(bytes(data))
    expected = json.loads((tmp_path / "v00000001" / "manifest.json").read_text())["shards"][1]["sha256"]
    with pytest.raises(ShardIntegrityError, match=f"{victim.name} is corrupted") as err:
        load_weights(pub.uri, pub.sha256)
    assert err.value.shard.endswith(victim.name)
    assert err.value.expected_sha256 == expected
    assert err.value.actual_sha256 == hashlib.sha256(bytes(data)).hexdigest()
    assert expected in str(err.value) and err.value.actual_sha256 in str(err.value)


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
    uris = [store.publish(sample_tensors(v), version=v).uri for v in range(1, 5)]
    assert store.versions() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004"]
    assert_same(load_weights(uris[-1]), sample_tensors(4))
    with pytest.raises(FileNotFoundError):
        load_weights(uris[0])


def test_republishing_a_version_replaces_it(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri(), max_shard_bytes=3000)
    store.publish(sample_tensors(1), version=5)
    pub = store.publish(sample_tensors(2)[:2], version=5)
    assert_same(load_weights(pub.uri, pub.sha256), sample_tensors(2)[:2])
    assert len(_shards(tmp_path, 5)) == len(read_manifest(pub.uri).shards)


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
    assert read_manifest(pub.uri).shards[0].file == shard.name

    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs, metadata={"k": "v"})
    buf = torch.frombuffer(bytearray(theirs.read_bytes()), dtype=torch.uint8)
    ours = read_safetensors(buf)
    for name, t in tensors.items():
        assert torch.equal(ours[name], t) and ours[name].dtype == t.dtype
