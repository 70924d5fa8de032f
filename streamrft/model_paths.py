"""Where a role finds its model: a local Hugging Face directory, or the name of a demo model that
``streamrft model prepare`` has converted into the cache."""
from __future__ import annotations

from pathlib import Path

from streamrft.engines.models import default_smollm2_dir, is_prepared
from streamrft.errors import ConfigError

DEMO_MODELS = {"smollm2-135m": default_smollm2_dir}


def resolve_model_path(path: str, key: str = "model.path") -> Path:
    """The model directory ``path`` names; ``key``: the config key it was given as (for the error)."""
    if path in DEMO_MODELS:
        directory = DEMO_MODELS[path]()
        if not is_prepared(directory):
            raise ConfigError(f"{key} {path!r}: the demo model is not prepared yet; run "
                              f"`streamrft model prepare {path}` (or scripts/setup.sh --demo) first")
        return directory
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{key} {path!r} is not a Hugging Face model directory (no config.json); "
                          "give a local model directory or smollm2-135m")
    return directory
