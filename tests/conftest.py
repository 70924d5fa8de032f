"""Shared fixtures. Kafka: one real broker per session (the embedded KRaft broker, or the cluster named by
KAFKA_BOOTSTRAP) and a fresh run name per test, so topics and groups never collide. Model: one tiny randomly
initialised model of the demo architecture per session."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

# trainer.mixed_precision "auto" measures whether bf16 pays on this CPU; the suite's float32 references and
# learning thresholds must not depend on the machine it runs on (roles started as processes inherit this too)
os.environ.setdefault("STREAMRFT_CPU_BF16_SPEEDUP", "1")
# a metric name a role writes to the metrics topic without a declaration fails the test that runs the role
# (streamrft/metric_catalog; roles started as processes inherit this too)
os.environ.setdefault("STREAMRFT_STRICT_METRICS", "1")


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> str:
    existing = os.environ.get("KAFKA_BOOTSTRAP")
    if existing:
        yield existing
        return
    from streamrft.broker import EmbeddedBroker

    with EmbeddedBroker(data_dir=tmp_path_factory.mktemp("kafka")) as broker:
        yield broker.bootstrap_servers


@pytest.fixture
def run_config(kafka_bootstrap: str):
    """A RunConfig on the session broker with a unique run name (and so unique topics and groups)."""
    from streamrft.config import load_config

    def make(**overrides):
        base = {"name": f"t{uuid.uuid4().hex[:10]}", "kafka": {"bootstrap_servers": kafka_bootstrap}}
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        return load_config(overrides=base, env={})

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from streamrft.engines.models import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, seed=0)
    return path
