"""``streamrft export CONFIG --version N DIR [--lineage ID]``: write a published weights version of a run as a
plain Hugging Face model directory (a LoRA adapter merged into the base model). Reads the run's object store
only; no broker is needed."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..errors import ConfigError
from .common import add_config_argument, config_from

console = Console()


def register(subparsers) -> None:
    export = subparsers.add_parser("export", help="write a published weights version as a Hugging Face model "
                                                  "directory (LoRA adapters merged)")
    add_config_argument(export, positional=True)
    export.add_argument("--version", type=int, required=True, help="the weights version to export (>= 1)")
    export.add_argument("--lineage", default=None, help="the trainer lineage it was published under (default: "
                                                        "the newest one holding that version)")
    export.add_argument("dest", type=Path, metavar="DIR", help="output directory")
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from streamrft.model_paths import resolve_model_path
    from streamrft.engines.weights.export import export_version

    config = config_from(args)
    base = resolve_model_path(config.model.path)
    with console.status(f"exporting v{args.version} of {config.name} to {args.dest}"):
        try:
            out = export_version(config.weights_url, args.version, base, args.dest, lora=config.model.lora,
                                 lineage=args.lineage)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    console.print(f"wrote {out} ({'base + merged LoRA adapter' if config.model.lora else 'whole weights'} of "
                  f"v{args.version})")
    return 0
