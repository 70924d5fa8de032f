"""Serve mode's HTTP server against slow and greedy clients, and what its answers let out: a non-loopback bind
needs an API key, TLS serves HTTPS, slow headers and bodies are cut off (408), connections are bounded (503), a
body over the cap is 413 whether declared or chunked, and error bodies (500, streamed, 504) carry no exception
text. One server (the real broker, the tiny model) for the module; TLS on a second HTTP server over its role."""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import socket
import ssl
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest

from streamrft.config import load_config
from streamrft.consumers.serve.http_server import http_server
from streamrft.errors import ConfigError

from .test_serve import KEY, QUESTION, serve_config, serving

pytestmark = [pytest.mark.kafka, pytest.mark.model]

AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "max_body_bytes": 4096, "max_connections": 8}
SECRET = "SECRET-ENGINE-DETAIL in /srv/engine.py"


@pytest.fixture(scope="module")
def served(kafka_bootstrap, tiny_model_dir, tmp_path_factory):
    def make(**overrides):
        base = {"name": f"t{uuid.uuid4().hex[:10]}", "kafka": {"bootstrap_servers": kafka_bootstrap}}
        return load_config(overrides={**base, **overrides}, env={})

    config = serve_config(make, tiny_model_dir, tmp_path_factory.mktemp("serve-security"), serve=LIMITS)
    with serving(config) as (clients, role, base, client):
        yield role, base, client


def _connect(base: str) -> socket.socket:
    url = urlparse(base)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def _answer_of(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when (seconds from now)."""
    started, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - started


def test_a_non_loopback_bind_needs_an_api_key(served):
    role = served[0]
    open_to_all = role.settings.model_copy(update={"api_key": None})
    with pytest.raises(ConfigError, match="serve.api_key"):
        http_server(role, host="0.0.0.0", settings=open_to_all)
    http_server(role, host="0.0.0.0", port=0)  # with the key: built (not started)
    http_server(role, host="127.0.0.1", port=0, settings=open_to_all)


def test_headers_sent_slowly_are_cut_off_with_408(served):
    sock = _connect(served[1])
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: serve\r\n")
    started = time.monotonic()
    try:
        for byte in b"X-Slow: " + b"a" * 40:  # one byte every 0.1 s: a slowloris, never done
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
    except OSError:
        pass  # the server closed the connection under it
    data, _ = _answer_of(sock)
    assert time.monotonic() - started < 1.0 + 2.0, "the slow client held its socket past the header timeout"
    assert data.startswith(b"HTTP/1.1 408") and b"header_timeout_s" in data, data


def test_a_body_sent_slowly_is_cut_off_with_408(served):
    sock = _connect(served[1])
    sock.sendall(b"POST /feedback HTTP/1.1\r\nHost: serve\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"reward\":")
    data, waited = _answer_of(sock)
    assert waited < 1.0 + 2.0 and data.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in data, data


def test_connections_are_bounded(served):
    base = served[1]
    idle = [_connect(base) for _ in range(LIMITS["max_connections"])]
    try:
        time.sleep(0.2)
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{base}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server stayed full after the connections closed"
        time.sleep(0.1)


def test_a_body_over_the_cap_is_413_declared_or_chunked(served):
    base, headers = served[1], {**AUTH, "Content-Type": "application/json"}
    big = json.dumps({"model": "tiny", "prompt": "a" * 5000, "max_tokens": 1}).encode()
    declared = httpx.post(f"{base}/v1/completions", content=big, headers=headers, timeout=30)
    chunked = httpx.post(f"{base}/v1/completions", content=iter([big[:3000], big[3000:]]), headers=headers, timeout=30)
    assert "content-length" not in chunked.request.headers and chunked.request.headers["transfer-encoding"] == "chunked"
    for answer in (declared, chunked):
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large", answer.text
    small = json.dumps({"model": "tiny", "prompt": "3 + 4 =", "max_tokens": 1}).encode()
    fine = httpx.post(f"{base}/v1/completions", content=iter([small[:10], small[10:]]), headers=headers, timeout=30)
    assert fine.status_code == 200, fine.text


def test_error_bodies_carry_no_exception_text(served, monkeypatch):
    role, base, client = served

    def broken_step():
        raise RuntimeError(SECRET)

    body = {"model": "tiny", "prompt": "3 + 4 =", "max_tokens": 2}
    monkeypatch.setattr(role.engine, "step", broken_step)
    failed = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    streamed = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=30)
    assert '"server_error"' in streamed.text
    for answer in (failed, streamed):
        assert "SECRET" not in answer.text and "Traceback" not in answer.text and "RuntimeError" not in answer.text

    monkeypatch.setattr(role.engine, "step", lambda: [])  # an engine that never finishes: the request times out
    monkeypatch.setattr(role.serving, "policy", dataclasses.replace(role.serving.policy, request_timeout_s=0.5))
    late = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert late.status_code == 504 and "serve.request_timeout_s" in late.json()["error"]["message"], late.text
    late_stream = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=30)
    assert '"timeout"' in late_stream.text and "serve.request_timeout_s" in late_stream.text
    for answer in (late, late_stream):
        assert "JobStopped" not in answer.text and "Traceback" not in answer.text


def _self_signed(directory) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_serves_https(served, tmp_path):
    role = served[0]
    cert, key = _self_signed(tmp_path)
    server = http_server(role, port=0, settings=role.settings.model_copy(update={"tls_cert": cert, "tls_key": key}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the HTTPS server did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        trusted = ssl.create_default_context(cafile=cert)
        answer = httpx.post(f"https://127.0.0.1:{port}/v1/chat/completions", verify=trusted, headers=AUTH,
                            json={"model": "tiny", "messages": QUESTION, "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200 and answer.json()["choices"], answer.text
        with pytest.raises(httpx.HTTPError):  # plain HTTP to it gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        server.should_exit = True
        thread.join(10)
