"""``streamrft serve CONFIG``: the run's inference engine behind an OpenAI-compatible HTTP API; completions that
get feedback become experiences the trainer learns from (see :mod:`streamrft.consumers.serve`)."""
from __future__ import annotations

import argparse
import logging
import threading

from ..errors import ConfigError
from .common import add_config_argument
from .roles import _run_role

logger = logging.getLogger(__name__)

def register(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="serve the run's model over an OpenAI-compatible HTTP API and "
                                                "learn from feedback on its answers")
    add_config_argument(serve, positional=True)
    serve.add_argument("--host", default=None, help="bind address (default serve.host)")
    serve.add_argument("--port", type=int, default=None, help="port (default serve.port; 0 = any free one)")
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"streamrft serve needs FastAPI and uvicorn ({exc.name} is missing): "
                          "pip install 'streamrft[serve]'") from None
    from streamrft.consumers.serve.http_server import check_exposure
    from streamrft.consumers.serve.role import ServeRole

    def build(config, clients, stop) -> ServeRole:
        check_exposure(args.host or config.serve.host, config.serve)  # before the engine loads, not after
        return ServeRole(config, clients, stop).start()

    def run(role: ServeRole) -> int:
        server = http_server(role, host=args.host, port=args.port)
        watcher = threading.Thread(target=_stop_on_request, args=(role, server), daemon=True)
        watcher.start()
        server.run()
        return 0

    return _run_role(args, build, run)


def http_server(role, *, host: str | None = None, port: int | None = None):
    """A uvicorn server for ``role`` (not started; see :mod:`streamrft.consumers.serve.http_server`)."""
    from streamrft.consumers.serve.http_server import http_server as guarded

    return guarded(role, host=host, port=port)


def _stop_on_request(role, server) -> None:
    while not role.stop.wait(1.0):
        pass
    server.should_exit = True
