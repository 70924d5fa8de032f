"""The HTTP server in front of serve mode's app: uvicorn, with what a server reachable by others needs.

- It binds a non-loopback address only with ``serve.api_key`` set: anyone who reaches it could otherwise post
  rewards into training. ``serve.tls_cert`` / ``serve.tls_key`` make it HTTPS.
- Slow clients cannot hold sockets: a request's headers must arrive within ``serve.header_timeout_s`` of its
  first byte and its body within ``serve.body_timeout_s`` of its headers (then 408 and the connection closes;
  uvicorn itself times out only idle kept-alive connections), a connection that sends nothing is closed like an
  idle one, and ``serve.max_connections`` bounds connections and requests at once (503 beyond).
"""
from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from streamrft.config.roles import ServeConfig
from streamrft.errors import ConfigError

KEEP_ALIVE_S = 75  # seconds an idle client connection is kept (above serving.MAX_RETRY_AFTER_S)


def http_server(role, *, host: str | None = None, port: int | None = None,
                settings: ServeConfig | None = None) -> uvicorn.Server:
    """A uvicorn server for ``role`` (not started), by ``settings`` (default the role's); ConfigError when they
    would expose it."""
    from .app import create_app

    settings = settings or role.settings
    host = host or settings.host
    check_exposure(host, settings)
    tls = {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key} if settings.tls_cert else {}
    # keep-alive longer than any Retry-After the server gives (app.py): a client that waits it out and sends on
    # its pooled connection must not find the server closing it at that moment (uvicorn's default is 5 s)
    config = uvicorn.Config(create_app(role), host=host, port=settings.port if port is None else port,
                            log_level="warning", access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                            limit_concurrency=settings.max_connections,
                            http=guarded_protocol(settings.header_timeout_s, settings.body_timeout_s), **tls)
    return uvicorn.Server(config)


def check_exposure(host: str, settings: ServeConfig) -> None:
    if settings.api_key is None and not is_loopback(host):
        raise ConfigError(f"serve.host {host!r} is reachable from other machines, and anyone who reaches the server "
                          "can post rewards into training: set serve.api_key (STREAMRFT_SERVE__API_KEY), or bind "
                          "127.0.0.1")
    for key in ("tls_cert", "tls_key"):
        path = getattr(settings, key)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"serve.{key} {path!r} is not a readable file: give the path of a PEM file")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def _timeout_answer(what: str, limit_s: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request's {what} did not arrive within serve.{what}_timeout_s "
                                            f"({limit_s:g}s)", "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def guarded_protocol(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and on its body (the module docstring).
    The deadline follows h11's view of the client: headers begun (bytes buffered while it waits for a request),
    body under way (``SEND_BODY``), or neither (no deadline: a response may stream as long as it takes)."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._phase: str | None = None
        self._deadline = None
        # a connection that never sends a byte is idle like a kept-alive one (uvicorn waits for it forever)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        state = self.conn.their_state
        phase = ("header" if state is h11.IDLE and self.conn.trailing_data[0] else
                 "body" if state is h11.SEND_BODY else None)
        if phase == self._phase:
            return
        self._disarm()
        self._phase = phase
        if phase is not None:
            limit = self.header_timeout_s if phase == "header" else self.body_timeout_s
            self._deadline = self.loop.call_later(limit, self._too_slow, phase, limit)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self, phase: str, limit_s: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if phase == "header" or self.cycle is None or not self.cycle.response_started:
            self.transport.write(_timeout_answer(phase, limit_s))
        self.transport.close()
