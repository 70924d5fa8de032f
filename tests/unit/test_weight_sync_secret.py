"""The weight-sync group's secret: `streamrft run` makes one per collective run for the trainer and the workers
only, keeps one the user set, and the roles read it from their environment as a secret that is never echoed."""
from __future__ import annotations

import pytest

from streamrft.commands.run import GROUP_SECRET_ENV, weight_sync_secret
from streamrft.config import load_config
from streamrft.errors import ConfigError

COLLECTIVE = {"trainer": {"weights": {"method": "collective"}}}


def test_a_collective_run_gets_a_fresh_secret_that_its_roles_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(GROUP_SECRET_ENV, raising=False)
    config = load_config(overrides=COLLECTIVE, env={})
    first, second = weight_sync_secret(config), weight_sync_secret(config)
    assert set(first) == {GROUP_SECRET_ENV} and first != second  # one per run, never a constant
    role = load_config(overrides=COLLECTIVE, env=first)
    assert role.trainer.weights.group_secret.get_secret_value() == first[GROUP_SECRET_ENV]
    assert first[GROUP_SECRET_ENV] not in repr(role)


def test_no_secret_is_made_where_none_is_needed_or_one_is_set(monkeypatch):
    monkeypatch.delenv(GROUP_SECRET_ENV, raising=False)
    assert weight_sync_secret(load_config(env={})) == {}  # object_store: no group
    set_in_config = {"trainer": {"weights": {"method": "collective", "group_secret": "s" * 24}}}
    assert weight_sync_secret(load_config(overrides=set_in_config, env={})) == {}
    monkeypatch.setenv(GROUP_SECRET_ENV, "e" * 24)
    assert weight_sync_secret(load_config(overrides=COLLECTIVE, env={})) == {}


def test_a_short_secret_is_refused_without_echoing_it():
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=COLLECTIVE, env={GROUP_SECRET_ENV: "tooshort"})
    assert "group_secret" in str(refused.value) and "tooshort" not in str(refused.value)
