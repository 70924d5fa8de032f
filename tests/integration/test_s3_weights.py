"""Weight stores on ``s3://``: the object store's publish, load and verification through s3fs against a real
S3-compatible server (s3proxy, filesystem backend) on loopback, started once for the module. A torn shard is
refused, a server killed between shards leaves no version half-visible and the next publish is complete, wrong
credentials are refused with a message that names the store and never the secret; and a rollout worker's
WeightFollower, configured by ``trainer.weights.s3``, loads what the trainer's publisher put there."""
from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

pytest.importorskip("s3fs", reason="s3fs is not installed: scripts/setup.sh --dev installs it (the s3 extra)")

from streamrft.config import load_config  # noqa: E402
from streamrft.config.object_store import S3Config  # noqa: E402
from streamrft.config.roles import WeightSyncConfig  # noqa: E402
from streamrft.engines.inference import create_engine  # noqa: E402
from streamrft.engines.weights import ShardIntegrityError  # noqa: E402
from streamrft.engines.weights.errors import StoreAccessError  # noqa: E402
from streamrft.engines.weights.object_store import ObjectStore, iter_weights, load_weights  # noqa: E402
from streamrft.objectstore import S3Proxy  # noqa: E402
from .s3_server import local_s3  # noqa: E402
from streamrft.weights.follower import WeightFollower  # noqa: E402
from streamrft.weights.publishers import ObjectStorePublisher  # noqa: E402

BUCKET = "weights"
KEY_ID = "streamrft-test"
SECRET_ENV = "STREAMRFT_TRAINER__WEIGHTS__S3__SECRET_ACCESS_KEY"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    yield from local_s3(tmp_path_factory, BUCKET, KEY_ID)


def s3_settings(server: S3Proxy, secret: str | None = None, key_id: str = KEY_ID) -> S3Config:
    return S3Config(endpoint_url=server.endpoint_url, region="us-east-1", access_key_id=key_id,
                    secret_access_key=secret or server._secret, path_style=True)


def options(server: S3Proxy, prefix: str, **s3) -> dict:
    """Storage options as a run's config makes them (``trainer.weights`` with an s3 section)."""
    return WeightSyncConfig(url=f"s3://{BUCKET}/{prefix}", s3=s3_settings(server, **s3)).storage_options()


@pytest.fixture(scope="module")
def model_tensors(tiny_model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """A tiny Llama's real tensors, as the trainer publishes them."""
    return sorted(load_file(tiny_model_dir / "model.safetensors").items())


def assert_same(got: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert list(got) == [name for name, _ in expected]
    for name, tensor in expected:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_publish_load_and_prune_through_s3(s3: S3Proxy, model_tensors):
    store = ObjectStore(f"s3://{BUCKET}/publish", keep_last=2, max_shard_bytes=64 << 10,
                        storage_options=options(s3, "publish"))
    published = store.publish(model_tensors, version=1)
    assert published.uri.startswith(f"s3://{BUCKET}/publish/v00000001/")
    on_disk = s3.basedir / BUCKET / "publish" / "v00000001"
    shards = sorted(on_disk.glob("model-*.safetensors"))
    assert len(shards) > 3 and (on_disk / "manifest.json").is_file(), "the objects are not where S3 put them"
    assert published.nbytes == sum(p.stat().st_size for p in shards)

    loaded = load_weights(published.uri, published.sha256, expected_version=1, storage_options=store.storage_options)
    assert_same(loaded, model_tensors)
    for version in (2, 3):
        store.publish(model_tensors, version=version)
    assert store.versions() == [2, 3]  # pruned on S3 as on a disk
    assert not list((s3.basedir / BUCKET / "publish").rglob(".tmp-*")), "temporary objects left behind"


def test_a_torn_shard_is_refused(s3: S3Proxy, model_tensors):
    opts = options(s3, "torn")
    store = ObjectStore(f"s3://{BUCKET}/torn", max_shard_bytes=64 << 10, storage_options=opts)
    published = store.publish(model_tensors, version=1)
    shard = f"{BUCKET}/torn/v00000001/model-00002-of-{len(list_shards(store, 1)):05d}.safetensors"
    original = store.fs.cat_file(shard)

    torn = bytearray(original)
    torn[len(torn) // 2] ^= 0xFF  # same size, one byte changed: only the digest can tell
    store.fs.pipe_file(shard, bytes(torn))
    with pytest.raises(ShardIntegrityError, match="model-00002.*corrupted"):
        load_weights(published.uri, published.sha256, storage_options=opts)

    store.fs.pipe_file(shard, original[: len(original) // 3])  # an upload cut short
    with pytest.raises(ShardIntegrityError, match="model-00002.*truncated"):
        list(iter_weights(published.uri, published.sha256, storage_options=opts))

    store.fs.pipe_file(shard, original)
    assert_same(load_weights(published.uri, published.sha256, storage_options=opts), model_tensors)


def list_shards(store: ObjectStore, version: int) -> list[str]:
    return [p for p in store.fs.ls(f"{store.root}/v{version:08d}", detail=False, refresh=True)
            if p.endswith(".safetensors")]


def test_the_server_killed_mid_publish_leaves_nothing_half_visible(s3: S3Proxy, model_tensors):
    # one attempt per request: a dead server fails the publish at once instead of after minutes of retries
    opts = options(s3, "restart") | {"config_kwargs": {"s3": {"addressing_style": "path"}, "connect_timeout": 2,
                                                       "read_timeout": 10, "retries": {"max_attempts": 1}},
                                     "skip_instance_cache": True}
    store = ObjectStore(f"s3://{BUCKET}/restart", max_shard_bytes=8 << 10, storage_options=opts)
    vdir = s3.basedir / BUCKET / "restart" / "v00000001"
    failure: list[BaseException] = []

    def publish():
        try:
            store.publish(model_tensors, version=1)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            failure.append(exc)

    publisher = threading.Thread(target=publish)
    publisher.start()
    deadline = time.monotonic() + 30
    while not list(vdir.glob("model-*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.005)
    s3.kill()  # between shards: at least one is in place, the manifest is not
    publisher.join(60)
    assert not publisher.is_alive(), "the publish hangs on a dead server"
    assert failure, "the publish finished before the server was killed; the test proves nothing"
    assert list(vdir.glob("model-*.safetensors")) and not (vdir / "manifest.json").exists()

    s3.start()  # the same directory on the same port
    reader = ObjectStore(f"s3://{BUCKET}/restart", storage_options=opts)
    assert reader.versions() == [], "an incomplete version is visible"

    published = store.publish(model_tensors, version=1)  # the trainer publishes again after a failure
    assert reader.versions() == [1]
    assert_same(load_weights(published.uri, published.sha256, expected_version=1, storage_options=opts),
                model_tensors)
    assert not list(vdir.glob(".tmp-*")), "the interrupted publish left temporary objects in the version"


@pytest.mark.parametrize("wrong", ["secret", "key id"])
def test_wrong_credentials_are_refused_without_showing_the_secret(s3: S3Proxy, model_tensors, wrong):
    bad_secret = "wrong-" + secrets.token_hex(16)
    bad = (options(s3, "creds", secret=bad_secret) if wrong == "secret"
           else options(s3, "creds", secret=bad_secret, key_id="nobody"))
    store = ObjectStore(f"s3://{BUCKET}/creds", storage_options=bad)
    with pytest.raises(StoreAccessError) as refused:
        store.publish(model_tensors[:2], version=1)
    message = str(refused.value)
    assert f"s3://{BUCKET}/creds" in message and "refused access" in message and "secret_access_key" in message
    assert bad_secret not in message and s3._secret not in message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__

    good = ObjectStore(f"s3://{BUCKET}/creds", storage_options=options(s3, "creds"))
    published = good.publish(model_tensors[:2], version=1)
    with pytest.raises(StoreAccessError) as refused:
        load_weights(published.uri, published.sha256, storage_options=bad)
    assert bad_secret not in str(refused.value)


class Trainer:
    """What ObjectStorePublisher reads of a training engine."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_weights(self):
        return iter(self.tensors.items())

    def publish_metadata(self) -> dict[str, str]:
        return {}


def run_config(s3: S3Proxy, secret: str):
    """A run whose weight store is on the server, the secret given the way a deployment gives it: the environment."""
    weights = {"url": f"s3://{BUCKET}/run", "s3": {"endpoint_url": s3.endpoint_url, "region": "us-east-1",
                                                    "access_key_id": KEY_ID, "path_style": True}}
    return load_config(overrides={"name": "t-s3", "trainer": {"weights": weights}}, env={SECRET_ENV: secret})


def test_a_worker_follows_weights_the_trainer_published_to_s3(s3: S3Proxy):
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}
    config = run_config(s3, s3._secret)
    signal = ObjectStorePublisher(config, "trainer").publish(Trainer(tensors), version=1)
    assert signal.uri.startswith(f"s3://{BUCKET}/run/")

    worker = create_engine("fake")
    worker.load_weights({"w": torch.zeros(4, 4), "b": torch.zeros(4)}, version=0)
    follower = WeightFollower(config, worker, "w0", CollectorRegistry())
    view = type("View", (), {"weights": signal, "collective_ready": None})()
    assert follower.swap_to_latest(view), follower.take_refusals()
    assert worker.version == 1

    bad_secret = "wrong-" + secrets.token_hex(16)
    refusing = WeightFollower(run_config(s3, bad_secret), create_engine("fake"), "w1", CollectorRegistry())
    assert not refusing.swap_to_latest(view)
    [refusal] = refusing.take_refusals()
    assert "refused access" in refusal.detail and bad_secret not in refusal.detail
