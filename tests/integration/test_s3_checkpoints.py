"""Trainer checkpoints on ``s3://`` against a real S3-compatible server (s3proxy, filesystem backend) on loopback,
started once for the module: a save resumes on a fresh machine (a new staging directory) at its exact step,
offsets, buffer, engine state and audit; a checkpoint whose manifest never arrived is ignored and its data cleaned
up; wrong credentials are refused with a message that names the store and never the secret."""
from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import torch

pytest.importorskip("s3fs", reason="s3fs is not installed: scripts/setup.sh --dev installs it (the s3 extra)")

from streamrft.config import load_config  # noqa: E402
from streamrft.consumers.trainer.remote_checkpoints import RemoteCheckpoints  # noqa: E402
from streamrft.consumers.trainer.role import _checkpoints  # noqa: E402
from streamrft.engines.weights.errors import StoreAccessError  # noqa: E402
from streamrft.errors import ConfigError  # noqa: E402
from streamrft.objectstore import S3Proxy  # noqa: E402
from .s3_server import local_s3  # noqa: E402

BUCKET = "ckpt"
KEY_ID = "streamrft-ckpt"
OFFSETS = {("run.experiences", 0): 17, ("run.experiences", 1): 5}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    yield from local_s3(tmp_path_factory, BUCKET, KEY_ID)


def run_config(server: S3Proxy, prefix: str, secret: str | None = None):
    """A run whose checkpoints and weights are on the server, as a user writes it (the secret from the env)."""
    s3 = {"endpoint_url": server.endpoint_url, "region": "us-east-1", "access_key_id": KEY_ID, "path_style": True}
    env = {"STREAMRFT_TRAINER__WEIGHTS__S3__SECRET_ACCESS_KEY": secret or server._secret}
    return load_config(overrides={"name": "s3ckpt", "trainer": {
        "checkpoint_dir": f"s3://{BUCKET}/{prefix}/checkpoints", "keep_checkpoints": 2,
        "weights": {"url": f"s3://{BUCKET}/{prefix}/weights", "s3": s3}}}, env=env)


def write_engine(step: int):
    def write(directory: Path) -> None:  # as the engine's save_state: torch.save into a local directory
        torch.save({"step": step, "weight": torch.full((4, 4), float(step))}, directory / "engine.pt")
    return write


def save(store: RemoteCheckpoints, step: int) -> None:
    store.record(step - 1, step, [f"e{step}"], [])
    buffered = [{"topic": "run.experiences", "partition": 0, "offset": 16, "timestamp_ms": 1, "value": b"\x00bin"}]
    store.save(step, write_engine(step), {tp: o + step for tp, o in OFFSETS.items()}, buffered,
               {"published_version": step})


def test_a_checkpoint_on_s3_resumes_on_a_fresh_machine_at_its_exact_step(s3: S3Proxy):
    store = _checkpoints(run_config(s3, "resume"), "main", primary=True)
    assert isinstance(store, RemoteCheckpoints) and store.latest() is None
    for step in (1, 2, 3):
        save(store, step)
    assert store.steps() == [2, 3]  # keep_checkpoints: 2, the oldest pruned from the store

    fresh = _checkpoints(run_config(s3, "resume"), "main", primary=True)  # a new staging dir: nothing local
    assert fresh.root != store.root and fresh.audit() == []
    checkpoint = fresh.load(fresh.latest())
    assert checkpoint.step == 3 and checkpoint.has_model and checkpoint.meta["published_version"] == 3
    assert checkpoint.offsets == {tp: o + 3 for tp, o in OFFSETS.items()}
    assert checkpoint.buffered[0]["value"] == b"\x00bin" and checkpoint.buffered[0]["offset"] == 16
    state = torch.load(checkpoint.path / "engine.pt")
    assert state["step"] == 3 and torch.equal(state["weight"], torch.full((4, 4), 3.0))
    assert [entry["eids"] for entry in fresh.audit()] == [["e1"], ["e2"], ["e3"]]


def test_a_checkpoint_without_its_manifest_is_ignored_and_cleaned_up(s3: S3Proxy):
    store = _checkpoints(run_config(s3, "torn"), "main", primary=True)
    save(store, 1)
    save(store, 2)
    # a trainer killed after uploading step 2's data and before its manifest: the data is there, the manifest not
    store.fs.rm_file(f"{store.remote}/step-00000002.json")
    torn = {Path(p).name for p in store.fs.ls(f"{store.remote}/data", detail=False, refresh=True)
            if Path(p).name.startswith("step-00000002")}
    assert len(torn) == 1
    fresh = _checkpoints(run_config(s3, "torn"), "main", primary=True)
    assert fresh.steps() == [1] and fresh.load(fresh.latest()).step == 1
    save(fresh, 2)  # the next save removes the torn upload's data
    names = {Path(p).name for p in fresh.fs.ls(f"{fresh.remote}/data", detail=False, refresh=True)}
    assert len(names) == 2 and not names & torn and fresh.steps() == [1, 2]


def test_wrong_credentials_are_refused_without_showing_the_secret(s3: S3Proxy):
    bad_secret = "wrong-" + secrets.token_hex(16)
    store = _checkpoints(run_config(s3, "creds", secret=bad_secret), "main", primary=True)
    with pytest.raises(StoreAccessError) as refused:
        store.latest()
    message = str(refused.value)
    assert f"s3://{BUCKET}/creds/checkpoints" in message and bad_secret not in message
    assert s3._secret not in message


def test_checkpoints_on_s3_need_the_weights_there_too():
    with pytest.raises(ConfigError, match="set trainer.weights.url to an s3:// URL as well"):
        load_config(overrides={"trainer": {"checkpoint_dir": f"s3://{BUCKET}/x"}}, env={})
