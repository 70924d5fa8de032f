"""The sync policy's answers for every style, without Kafka (streamrft/pacing.py), and the config keys it is
built from (the ``sync:`` section, and the old ``explorer:`` keys that still load)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from streamrft.config import load_config
from streamrft.errors import ConfigError
from streamrft.pacing import Pacing, SyncStyle


@dataclass
class Versions:
    version: int = 0
    requested_version: int = 0


def pacing(style: str, **knobs) -> Pacing:
    return Pacing(SyncStyle(style), **knobs)


def no_lag() -> int:
    return 0


# -- the explorer: which weights a step needs --------------------------------------------------------------
@pytest.mark.parametrize("step,expected", [(0, 0), (1, 1), (2, 2), (7, 7)])
def test_fixed_sync_every_step_is_on_policy(step, expected):
    assert pacing("fixed", interval=1, offset=0, max_staleness=5).required_version(step) == expected


@pytest.mark.parametrize("step,expected", [(0, 0), (1, 0), (2, 2), (3, 2), (4, 4)])
def test_fixed_sync_interval_two_runs_two_steps_per_version(step, expected):
    assert pacing("fixed", interval=2, offset=0, max_staleness=0).required_version(step) == expected


@pytest.mark.parametrize("step,expected", [(0, 0), (1, 0), (2, 1), (5, 4)])
def test_fixed_sync_offset_lets_the_explorer_run_ahead(step, expected):
    assert pacing("fixed", interval=1, offset=1, max_staleness=0).required_version(step) == expected


@pytest.mark.parametrize("style", ["fully_async", "trainer_driven"])
def test_async_styles_bound_staleness_by_max_staleness(style):
    p = pacing(style, interval=1, offset=0, max_staleness=3)
    assert p.required_version(10) == 7
    assert p.hold(10, Versions(7, 7), no_lag) is None
    hold = p.hold(10, Versions(6, 6), no_lag)  # step − version = 4 > 3
    assert hold.cause == "weights" and "v7 (has v6)" in hold.waits_for


def test_trainer_driven_counts_and_names_the_requested_version_not_the_newest():
    p = pacing("trainer_driven", max_staleness=2)
    published_more = Versions(version=9, requested_version=4)
    assert p.counted_version(published_more) == 4
    assert p.hold(7, published_more, no_lag) is not None and "sync request for v5" in p.hold(7, published_more,
                                                                                                  no_lag).waits_for
    assert p.hold(6, published_more, no_lag) is None
    assert p.min_model_version(6, published_more) == 4  # workers move when the trainer says so, and no further
    assert pacing("fully_async", max_staleness=2).counted_version(published_more) == 9
    assert pacing("fully_async", max_staleness=2).min_model_version(6, published_more) == 4  # 6 − 2


def test_fixed_requests_name_the_version_the_step_was_allowed_on():
    p = pacing("fixed", interval=2, offset=1)
    assert [p.min_model_version(s, Versions(10, 10)) for s in range(5)] == [0, 0, 1, 1, 3]


def test_the_trainer_lag_holds_a_step_only_when_the_weights_allow_it():
    p = pacing("fixed", max_buffered_batches=4, experiences_per_step=32)
    asked = []

    def lag(value):
        def read():
            asked.append(value)
            return value
        return read

    assert p.hold(0, Versions(), lag(128)) is None  # 4 steps' worth: still allowed
    assert p.hold(0, Versions(), lag(129)).cause == "lag"
    assert p.hold(0, Versions(), lag(None)).cause == "cluster"
    assert p.hold(3, Versions(1), lag(0)).cause == "weights" and asked == [128, 129, None]  # not asked then


@pytest.mark.parametrize("style", ["fixed", "trainer_driven", "fully_async"])
def test_explore_mode_paces_nothing(style):
    p = pacing(style, max_staleness=0, max_buffered_batches=1, paced=False)

    def no_cluster():
        raise AssertionError("explore mode asks for no trainer lag")

    assert p.hold(50, Versions(), no_cluster) is None
    assert p.min_model_version(50, Versions(3, 3)) == 0
    assert p.describe() == f"explore mode: no trainer, {style} not applied"


# -- the trainer ---------------------------------------------------------------------------------------------
def test_staleness_bound_covers_fixed_pacing_by_design():
    assert pacing("fixed", interval=1, max_staleness=1).staleness_bound == 1
    assert pacing("fixed", interval=4, offset=1, max_staleness=1).staleness_bound == 4
    assert pacing("trainer_driven", interval=4, max_staleness=2).staleness_bound == 2
    assert pacing("fully_async", interval=4, max_staleness=2).staleness_bound == 2


@pytest.mark.parametrize("style", ["fixed", "trainer_driven", "fully_async"])
def test_the_trainer_publishes_every_interval_versions(style):
    assert [v for v in range(1, 9) if pacing(style, interval=3).publishes_at(v)] == [3, 6]


def test_sync_requests_only_under_trainer_driven_every_request_interval():
    assert [v for v in range(1, 7) if pacing("trainer_driven", interval=1, request_interval=2).sync_request_due(v)
            ] == [2, 4, 6]
    assert [v for v in range(1, 7) if pacing("trainer_driven", interval=3).sync_request_due(v)] == [3, 6]
    assert not any(pacing(style, interval=1).sync_request_due(v) for style in ("fixed", "fully_async")
                   for v in range(1, 7))


def test_only_fully_async_engines_follow_the_latest_version():
    assert [style.value for style in SyncStyle if Pacing(style).follows_latest] == ["fully_async"]


def test_descriptions():
    assert pacing("fixed", interval=2, offset=1).describe() == "fixed: sync every 2 step(s), offset 1"
    assert pacing("trainer_driven", max_staleness=2).describe() == ("trainer_driven: at most 2 step(s) ahead of "
                                                                    "the weights the trainer requested")
    assert pacing("fully_async", max_staleness=3).describe() == "fully_async: at most 3 step(s) ahead of the weights"


# -- built from the config -------------------------------------------------------------------------------
def test_pacing_is_built_from_the_sync_section_and_the_run_shape():
    config = load_config(overrides={"sync": {"style": "fully_async", "interval": 2, "max_staleness": 3,
                                             "max_buffered_batches": 2}, "mode": "explore",
                                    "explorer": {"batch_size": 4, "repeat_times": 2}}, env={})
    assert Pacing.of(config) == Pacing(SyncStyle.FULLY_ASYNC, interval=2, offset=0, max_staleness=3,
                                       max_buffered_batches=2, experiences_per_step=8, paced=False)


def test_the_old_keys_still_load_with_a_deprecation_message(caplog):
    with caplog.at_level(logging.WARNING):
        config = load_config(overrides={"explorer": {"sync_style": "trainer_driven", "sync_interval": 2,
                                                     "sync_offset": 1, "max_staleness": 3, "max_buffered_batches": 5,
                                                     "total_steps": 7},
                                        "trainer": {"sync_request_interval": 4}}, env={})
    assert config.sync.model_dump() == {"style": "trainer_driven", "interval": 2, "offset": 1, "max_staleness": 3,
                                        "request_interval": 4, "max_buffered_batches": 5}
    assert config.explorer.max_steps == 7
    assert "explorer.sync_style is deprecated; write it as sync.style" in caplog.text
    assert "trainer.sync_request_interval is deprecated; write it as sync.request_interval" in caplog.text
    env = load_config(env={"STREAMRFT_EXPLORER__SYNC_STYLE": "fully_async"})
    assert env.sync.style == "fully_async"


def test_a_key_in_its_old_and_its_new_place_is_refused():
    with pytest.raises(ConfigError, match="explorer.sync_style and sync.style are both set"):
        load_config(overrides={"explorer": {"sync_style": "fixed"}, "sync": {"style": "fully_async"}}, env={})
