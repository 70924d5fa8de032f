"""Serve mode binds beyond loopback only with an API key, and its TLS settings come as a pair of files."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from streamrft.config.roles import ServeConfig
from streamrft.consumers.serve.http_server import check_exposure, is_loopback
from streamrft.errors import ConfigError


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "serve.example"])
def test_a_reachable_address_without_an_api_key_is_refused(host):
    with pytest.raises(ConfigError, match="set serve.api_key") as refused:
        check_exposure(host, ServeConfig())
    assert "127.0.0.1" in str(refused.value)
    check_exposure(host, ServeConfig(api_key="k"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_api_key(host):
    assert is_loopback(host)
    check_exposure(host, ServeConfig())


def test_tls_needs_its_certificate_and_key_files(tmp_path):
    with pytest.raises(ValidationError, match="set both"):
        ServeConfig(tls_cert=str(tmp_path / "cert.pem"))
    missing = ServeConfig(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"))
    with pytest.raises(ConfigError, match="serve.tls_cert .* is not a readable file"):
        check_exposure("127.0.0.1", missing)
    (tmp_path / "cert.pem").write_text("pem")
    (tmp_path / "key.pem").write_text("pem")
    check_exposure("127.0.0.1", missing)

