"""A local S3-compatible object store (s3proxy on its filesystem backend) for trying ``s3://`` weight stores and
for the tests: resolved from Maven Central at set-up time (``streamrft s3 setup``), served on loopback."""
from __future__ import annotations

from .s3proxy import S3PROXY_VERSION, S3Proxy, ensure_s3proxy

__all__ = ["S3PROXY_VERSION", "S3Proxy", "ensure_s3proxy"]
