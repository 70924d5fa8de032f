"""``trainer.weights.s3``: the settings become s3fs storage options, bad ones fail at load with how to fix them,
and the secret is never echoed."""
from __future__ import annotations

import pytest

from streamrft.config import load_config
from streamrft.errors import ConfigError

SECRET = "sEcReT-0123456789"
ENV = "STREAMRFT_TRAINER__WEIGHTS__S3__SECRET_ACCESS_KEY"


def weights(url: str = "s3://bucket/weights", env: dict | None = None, **s3):
    overrides = {"name": "t-s3", "trainer": {"weights": {"url": url, "s3": s3}}}
    return load_config(overrides=overrides, env=env if env is not None else {ENV: SECRET}).trainer.weights


def test_the_settings_are_the_storage_options_of_s3fs():
    w = weights(endpoint_url="http://127.0.0.1:9000/", region="eu-west-1", access_key_id="AKID", path_style=True)
    assert w.storage_options() == {"key": "AKID", "secret": SECRET, "endpoint_url": "http://127.0.0.1:9000",
                                   "client_kwargs": {"region_name": "eu-west-1"},
                                   "config_kwargs": {"s3": {"addressing_style": "path"}}}
    assert SECRET not in repr(w) and SECRET not in str(w.model_dump())


def test_without_keys_s3fs_searches_the_environment_itself():
    assert weights(env={}).storage_options() == {}
    assert weights(url="", env={}).storage_options() == {}  # a local store takes no options


@pytest.mark.parametrize("s3, env, says", [
    ({"endpoint_url": "127.0.0.1:9000"}, {}, "must start with http:// or https://"),
    ({"region": "EU West"}, {}, "region name such as us-east-1"),
    ({"access_key_id": "AKID"}, {}, "set access_key_id and secret_access_key together"),
    ({}, {ENV: SECRET}, "set access_key_id and secret_access_key together"),
])
def test_bad_settings_fail_at_load_without_the_secret(s3, env, says):
    with pytest.raises(ConfigError, match=says) as failed:
        weights(env=env, **s3)
    assert SECRET not in str(failed.value)


def test_s3_settings_need_an_s3_url():
    with pytest.raises(ConfigError, match="set url to s3://") as failed:
        weights(url="file:///tmp/weights", access_key_id="AKID")
    assert SECRET not in str(failed.value)
