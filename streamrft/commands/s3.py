"""``streamrft s3``: a local S3-compatible server (s3proxy, filesystem backend) to try ``s3://`` weight stores
without a cloud account. ``setup`` resolves its jar ahead of time (scripts/setup.sh --dev does), ``serve`` runs it
on loopback until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import tempfile
import threading
from pathlib import Path

from rich.console import Console

from ..objectstore import S3PROXY_VERSION, S3Proxy, ensure_s3proxy

console = Console(stderr=True)
SECRET_ENV = "STREAMRFT_S3_SECRET_ACCESS_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser("s3", help="a local S3-compatible server (s3proxy) for s3:// weight stores")
    actions = parser.add_subparsers(dest="s3_action", metavar="ACTION", required=True)

    setup = actions.add_parser("setup", help="download s3proxy now (Maven) and check that it starts")
    setup.add_argument("--no-check", action="store_true", help="only resolve the jar; do not start the server")
    setup.set_defaults(func=setup_s3proxy)

    serve = actions.add_parser("serve", help="serve a directory over S3 on 127.0.0.1 until Ctrl-C")
    serve.add_argument("--dir", required=True, help="where the objects live (one subdirectory per bucket)")
    serve.add_argument("--port", type=int, default=9000, help="port on 127.0.0.1 (9000)")
    serve.add_argument("--bucket", action="append", default=[], help="create this bucket if missing (repeatable)")
    serve.add_argument("--access-key-id", default="streamrft", help="the one access key id it accepts")
    serve.set_defaults(func=serve_s3proxy)


def setup_s3proxy(args: argparse.Namespace) -> int:
    jar = ensure_s3proxy()
    console.print(f"s3proxy {S3PROXY_VERSION}: {jar}")
    if args.no_check:
        return 0
    with console.status("checking that s3proxy starts…"), tempfile.TemporaryDirectory() as basedir:
        server = S3Proxy(Path(basedir), "setup-check", secrets.token_hex(16))
        with server:
            rss = server.rss_bytes()
    console.print(f"s3proxy started in {server.startup_s:.2f} s ({rss / 2**20:.0f} MiB resident) and stopped")
    return 0


def serve_s3proxy(args: argparse.Namespace) -> int:
    basedir = Path(args.dir).expanduser().resolve()
    for bucket in args.bucket:
        (basedir / bucket).mkdir(parents=True, exist_ok=True)  # the filesystem backend: a bucket is a directory
    secret, where = _secret(basedir)
    server = S3Proxy(basedir, args.access_key_id, secret, port=args.port)
    with console.status(f"starting s3proxy {S3PROXY_VERSION} on 127.0.0.1:{args.port}…"):
        server.start()
    console.print(
        f"s3proxy serving {basedir} at {server.endpoint_url} (started in {server.startup_s:.2f} s). Point a run at "
        f"it with trainer.weights: {{url: s3://<bucket>/weights, s3: {{endpoint_url: {server.endpoint_url}, "
        f"access_key_id: {args.access_key_id}, path_style: true}}}} and "
        f"STREAMRFT_TRAINER__WEIGHTS__S3__SECRET_ACCESS_KEY={where}. Ctrl-C stops it.")
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _secret(basedir: Path) -> tuple[str, str]:
    """The secret from $STREAMRFT_S3_SECRET_ACCESS_KEY, else one kept in a file only this user can read; and how a
    shell gets it (the secret itself is never printed)."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV], f'"${SECRET_ENV}"'
    path = basedir.parent / f".{basedir.name}.s3-secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(20))
    return path.read_text().strip(), f'"$(cat {path})"'

