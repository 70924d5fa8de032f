"""trainer.mixed_precision: "auto" on a CPU follows a measured probe of bf16 against float32 matmuls."""
from __future__ import annotations

import pytest
import torch

from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines import precision
from streamrft.engines.training.parallel import SingleProcess

from .test_training_engine import tiny_llama

CPU = torch.device("cpu")


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch):
    """Sets what the probe 'measures' (through the variable that stands in for it) and forgets the cached one."""
    def measured(speedup: str | None) -> None:
        precision.cpu_bf16_speedup.cache_clear()
        if speedup is None:
            monkeypatch.delenv(precision.SPEEDUP_ENV, raising=False)
        else:
            monkeypatch.setenv(precision.SPEEDUP_ENV, speedup)
    yield measured
    precision.cpu_bf16_speedup.cache_clear()


@pytest.mark.parametrize("speedup, expected", [("2.4", torch.bfloat16), ("1.29", None), ("0.6", None)])
def test_auto_on_a_cpu_takes_bf16_only_where_it_pays(probe, speedup: str, expected) -> None:
    probe(speedup)
    assert precision.autocast_dtype("auto", CPU, SingleProcess()) is expected


def test_an_explicit_choice_is_kept_whatever_the_probe_says(probe) -> None:
    probe("5")
    assert precision.autocast_dtype("no", CPU, SingleProcess()) is None
    probe("0.5")
    assert precision.autocast_dtype("bf16", CPU, SingleProcess()) is torch.bfloat16


def test_the_probe_measures_a_positive_ratio_once_per_process(probe) -> None:
    probe(None)
    first = precision.cpu_bf16_speedup()
    assert 0 < first < 100
    assert precision.cpu_bf16_speedup() == first  # cached: every model of the process gets the same answer


def test_a_pinned_speedup_that_is_not_a_number_names_the_variable(probe) -> None:
    probe("fast")
    with pytest.raises(ValueError, match="STREAMRFT_CPU_BF16_SPEEDUP='fast' is not a number"):
        precision.cpu_bf16_speedup()


def test_the_engine_autocasts_to_what_auto_chose(probe) -> None:
    probe("3")
    assert TrainingEngine(tiny_llama(), TrainingSettings(), device="cpu").autocast_dtype is torch.bfloat16
    probe("1")
    assert TrainingEngine(tiny_llama(), TrainingSettings(), device="cpu").autocast_dtype is None


@pytest.mark.parametrize("speedup, expected", [("2.4", "bfloat16"), ("1.0", "float32")])
def test_a_rollout_engine_on_a_cpu_runs_in_what_the_probe_says_pays(probe, speedup: str, expected: str) -> None:
    probe(speedup)
    assert precision.inference_dtype("auto", "cpu") == expected
    assert precision.inference_dtype("float32", "cpu") == "float32"  # a choice is kept
    assert precision.inference_dtype("auto", "cuda") == "auto"  # on a GPU the checkpoint's own dtype
