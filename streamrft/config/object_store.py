"""``trainer.weights.s3``: how a weight store at an ``s3://`` URL is reached (s3fs, the ``s3`` extra). The trainer
publishes with these settings and the rollout workers and serve mode read with the same ones, so one section
serves every role. Keys left empty fall back to s3fs's own search: the ``AWS_*`` environment, ``~/.aws``, an
instance role."""
from __future__ import annotations

import re
from importlib.util import find_spec
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator

from .base import Section

S3_PROTOCOLS = ("s3://", "s3a://")
_REGION = re.compile(r"^[a-z0-9-]{0,40}$")


class S3Config(Section):
    endpoint_url: str = Field(default="", max_length=2048,
                              description="an S3-compatible server, e.g. http://127.0.0.1:9000 (MinIO, s3proxy, "
                                          "Ceph); empty = AWS S3")
    region: str = Field(default="", max_length=40, description="the bucket's region, e.g. eu-west-1; empty = the "
                                                               "AWS_DEFAULT_REGION or ~/.aws default")
    access_key_id: str = Field(default="", max_length=256,
                               description="the access key id; empty = s3fs's own search (AWS_ACCESS_KEY_ID, "
                                           "~/.aws, an instance role)")
    secret_access_key: SecretStr | None = Field(
        default=None, description="the access key's secret; set it through the environment "
                                  "(STREAMRFT_TRAINER__WEIGHTS__S3__SECRET_ACCESS_KEY), not in a config file")
    path_style: bool = Field(default=False, description="address objects as http://host/bucket/key, as most "
                                                        "S3-compatible servers want, instead of http://bucket.host/key")

    @field_validator("endpoint_url")
    @classmethod
    def _http_endpoint(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("endpoint_url must start with http:// or https:// (empty for AWS S3)")
        return value.rstrip("/")

    @field_validator("region")
    @classmethod
    def _region_name(cls, value: str) -> str:
        if not _REGION.match(value):
            raise ValueError("region must be a region name such as us-east-1 (lowercase letters, digits, dashes)")
        return value

    @model_validator(mode="after")
    def _key_pair(self) -> "S3Config":
        if bool(self.access_key_id) != (self.secret_access_key is not None):
            raise ValueError("set access_key_id and secret_access_key together (or neither, for s3fs's own search "
                             "of the AWS_* environment and ~/.aws)")
        return self

    @property
    def configured(self) -> bool:
        return self != S3Config()

    def storage_options(self) -> dict[str, Any]:
        """The keyword arguments of ``s3fs.S3FileSystem`` (fsspec storage options) these settings stand for."""
        options: dict[str, Any] = {}
        if self.access_key_id and self.secret_access_key is not None:
            options["key"] = self.access_key_id
            options["secret"] = self.secret_access_key.get_secret_value()
        if self.endpoint_url:
            options["endpoint_url"] = self.endpoint_url
        if self.region:
            options["client_kwargs"] = {"region_name": self.region}
        if self.path_style:
            options["config_kwargs"] = {"s3": {"addressing_style": "path"}}
        return options


def is_s3_url(url: str) -> bool:
    return url.startswith(S3_PROTOCOLS)


def check_s3_store(url: str, s3: S3Config) -> None:
    """The cross-field rules of ``trainer.weights``: S3 settings only with an ``s3://`` URL, and s3fs installed
    for one (checked without importing it)."""
    if s3.configured and not is_s3_url(url):
        raise ValueError(f"trainer.weights.s3 is set but trainer.weights.url is {url or '(empty: a local directory)'}; "
                         "set url to s3://<bucket>/<prefix>, or remove the s3 section")
    if is_s3_url(url) and find_spec("s3fs") is None:
        raise ValueError(f"trainer.weights.url is {url}, and s3fs is not installed: pip install 'streamrft[s3]'")
