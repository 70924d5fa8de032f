"""A real S3-compatible server (s3proxy, filesystem backend) on loopback for a test module, or a skip that says
what is missing."""
from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from streamrft.broker.jars import find_java
from streamrft.errors import StreamrftError
from streamrft.objectstore import S3Proxy
from streamrft.objectstore.s3proxy import s3proxy_home


def local_s3(tmp_path_factory: pytest.TempPathFactory, bucket: str, key_id: str) -> Iterator[S3Proxy]:
    """A started server holding ``bucket``, with credentials ``key_id`` and a random secret; stopped after."""
    try:
        find_java()
    except StreamrftError as exc:
        pytest.skip(f"s3proxy needs Java 17+: {exc}")
    if not (s3proxy_home() / "resolved.ok").exists():
        pytest.skip("s3proxy is not resolved yet: run `streamrft s3 setup` (scripts/setup.sh --dev does)")
    basedir = tmp_path_factory.mktemp("s3proxy")
    (basedir / bucket).mkdir()  # the filesystem backend: a bucket is a directory
    server = S3Proxy(basedir, key_id, secrets.token_hex(20))
    server.start()
    yield server
    server.stop()
