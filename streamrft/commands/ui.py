"""``streamrft ui -c CONFIG``: a read-only web UI of the run's cluster and of the monitor's files, on
127.0.0.1:8089 by default (see :mod:`streamrft.ui`)."""
from __future__ import annotations

import argparse
import time

from ..errors import ConfigError
from ..ui import DEFAULT_PORT
from .common import add_config_argument, config_from, console, open_run


def register(subparsers) -> None:
    parser = subparsers.add_parser("ui", help="a read-only web UI of the run's topics, consumer groups, records, "
                                              "dead letters and steps")
    add_config_argument(parser)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1: the UI has no login)")
    parser.add_argument("--port", type=int, default=None, help=f"port (default {DEFAULT_PORT}; 0 = any free one)")
    parser.add_argument("--sample-s", type=float, default=None, help="seconds between lag samples (default 5)")
    parser.add_argument("--history", type=int, default=None, help="lag samples kept per group and topic (720)")
    parser.add_argument("--records", type=int, default=None, help="records shown per topic (default 50)")
    parser.add_argument("--scan", type=int, default=None,
                        help="offsets per partition a search by key reads back from the end (default 5000)")
    parser.set_defaults(func=run_ui)


def run_ui(args: argparse.Namespace) -> int:
    from ..ui.settings import settings_from

    settings = settings_from(host=args.host, port=args.port, sample_s=args.sample_s, history=args.history,
                             records=args.records, scan=args.scan)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise ConfigError(f"streamrft ui needs FastAPI and uvicorn ({exc.name} is missing): "
                          "pip install 'streamrft[ui]'") from None
    from streamrft.consumers.monitor import STEPS_CSV

    from ..ui.app import UiState, create_app
    from ..ui.cluster import ClusterView
    from ..ui.lag_history import LagHistory, LagSampler

    config = config_from(args)
    started = time.monotonic()
    with console.status(f"connecting to the cluster of run {config.name}"), \
            open_run(config, create_topics=False, shared_broker=True) as clients:
        view = ClusterView(clients.config, clients)
        view.topic_names()  # fails here, with the client layer's message, when the cluster does not answer
        history = LagHistory(settings.history)
        sampler = LagSampler(view.groups, history, settings.sample_s)
        sampler.start()
        state = UiState(view, history, settings, config.output_dir / STEPS_CSV)
        server = uvicorn.Server(uvicorn.Config(create_app(state), host=settings.host, port=settings.port,
                                               log_level="warning", access_log=False))
        _announce_when_up(server, config.name, started)
        try:
            server.run()
        finally:
            sampler.stop()
    return 0


def _announce_when_up(server, run: str, started: float) -> None:
    """Print the UI's address once uvicorn listens (with port 0, only then is it known)."""
    original = server.startup

    async def startup(sockets=None):
        await original(sockets=sockets)
        for listening in server.servers:
            for sock in listening.sockets:
                host, port = sock.getsockname()[:2]
                console.print(f"streamrft ui of run {run}: http://{host}:{port}/ (read-only; up in "
                              f"{time.monotonic() - started:.1f} s; Ctrl-C stops it)", highlight=False)

    server.startup = startup
