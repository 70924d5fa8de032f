"""The run config's auxiliary models, judge and distillation sections: what they accept, the cross-checks that
say how to fix a run, secrets never echoed, and the worker-side builder that turns them into engines."""
from __future__ import annotations

import pytest

from streamrft.config import load_config
from streamrft.errors import ConfigError

OPENAI_JUDGE = {"engine": "openai", "model": "judge-7b", "base_url": "http://judge:8000/v1"}


def test_no_auxiliary_models_by_default_and_a_round_trip_keeps_them():
    import yaml

    config = load_config(env={})
    assert config.auxiliary_models == {} and config.judge is None and config.distillation.teacher is None
    given = load_config(overrides={"auxiliary_models": {"teacher": {"model": "t"}, "judge": OPENAI_JUDGE},
                                   "judge": {"model": "judge", "max_score": 5}, "distillation": {"teacher": "teacher"},
                                   "trainer": {"algorithm": {"advantage": "distill"}}}, env={})
    assert given.judge.max_score == 5 and given.auxiliary_models["judge"].engine == "openai"
    again = load_config(overrides=yaml.safe_load(yaml.safe_dump(given.model_dump(mode="json", by_alias=True))),
                        env={})  # what role processes load: every section written out, defaults included
    assert again.auxiliary_models == given.auxiliary_models and again.judge == given.judge
    assert again.training_settings.uses_teacher


@pytest.mark.parametrize("overrides, message", [
    ({"judge": {"model": "grader"}}, r"judge.model 'grader' is not one of auxiliary_models \(none\); add it"),
    ({"distillation": {"teacher": "big"}, "auxiliary_models": {"judge": OPENAI_JUDGE}},
     r"distillation.teacher 'big' is not one of auxiliary_models \(judge\)"),
    ({"distillation": {"teacher": "judge"}, "auxiliary_models": {"judge": OPENAI_JUDGE}},
     "a teacher scores the student's tokens by teacher forcing, .* set auxiliary_models.judge.engine: transformers"),
    ({"trainer": {"algorithm": {"advantage": "distill"}}}, "set distillation.teacher to one of auxiliary_models"),
    ({"trainer": {"algorithm": {"distill_coef": 0.1}}}, "set distillation.teacher"),
    ({"rollout": {"engine": "vllm"}, "auxiliary_models": {"judge": {"engine": "vllm", "model": "j"}}},
     r"rollout.vllm.gpu_memory_utilization \(0.85\) \+ auxiliary_models.judge.vllm.gpu_memory_utilization "
     r"\(0.85\) is more than the whole GPU"),
    ({"auxiliary_models": {"judge": {"engine": "openai", "model": "m"}}}, "engine openai needs base_url"),
    ({"auxiliary_models": {"judge": {"model": "m", "base_url": "http://x/v1"}}}, "base_url and api_key are for "
                                                                                   "engine openai"),
    ({"auxiliary_models": {"judge": {"engine": "sglang", "model": "m"}}}, "auxiliary_models.judge.engine"),
    ({"judge": {"model": "judge", "score_pattern": "("}, "auxiliary_models": {"judge": OPENAI_JUDGE}},
     "judge.score_pattern.*not a regular expression"),
])
def test_bad_auxiliary_settings_fail_at_start_saying_how_to_fix_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, env={})


def test_shares_of_one_gpu_that_fit_are_accepted():
    config = load_config(overrides={"rollout": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.5}},
                                    "auxiliary_models": {"judge": {"engine": "vllm", "model": "j",
                                                                   "vllm": {"gpu_memory_utilization": 0.3}}}},
                         env={})
    assert config.auxiliary_models["judge"].vllm.gpu_memory_utilization == 0.3


def test_an_auxiliary_api_key_is_a_secret_set_by_environment_and_never_echoed():
    secret = "sk-987654321"
    config = load_config(overrides={"auxiliary_models": {"judge": OPENAI_JUDGE}},
                         env={"STREAMRFT_AUXILIARY_MODELS__JUDGE__API_KEY": secret})
    assert config.auxiliary_models["judge"].api_key.get_secret_value() == secret
    assert secret not in repr(config) and secret not in str(config.model_dump())
    for bad in ({"api_key": 987654321}, {"api_key": secret, "base_url": "judge:8000"}):
        with pytest.raises(ConfigError) as caught:
            load_config(overrides={"auxiliary_models": {"judge": {**OPENAI_JUDGE, **bad}}}, env={})
        assert "987654321" not in str(caught.value)


@pytest.mark.model
def test_the_worker_builds_each_auxiliary_model_and_names_the_key_of_a_bad_path(tiny_model_dir, tmp_path):
    from streamrft.consumers.rollout.auxiliary import build_auxiliary
    from streamrft.engines.inference import create_engine

    policy = create_engine("fake", tiny_model_dir)
    config = load_config(overrides={"model": {"path": str(tiny_model_dir)}, "distillation": {"teacher": "teacher"},
                                    "auxiliary_models": {"teacher": {"model": str(tiny_model_dir), "max_batch_size": 4},
                                                         "judge": {**OPENAI_JUDGE, "api_key": "k"}}}, env={})
    engines = build_auxiliary(config, policy)
    assert {name: e.kind for name, e in engines.items()} == {"teacher": "transformers", "judge": "openai"}
    assert engines["teacher"].max_batch_size == 4 and engines["judge"].model == "judge-7b"
    missing = load_config(overrides={"auxiliary_models": {"judge": {"model": str(tmp_path / "nowhere")}}}, env={})
    with pytest.raises(ConfigError, match=r"auxiliary_models.judge.model '.*nowhere' is not a Hugging Face model"):
        build_auxiliary(missing, policy)
