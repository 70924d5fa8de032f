"""One logging set-up for the CLI and the role processes."""
from __future__ import annotations

import logging
import os

from rich.console import Console
from rich.logging import RichHandler


def configure_logging(verbosity: int = 0) -> None:
    """INFO by default, DEBUG with -vv; STREAMRFT_LOG_LEVEL (e.g. WARNING) overrides both."""
    default = "DEBUG" if verbosity >= 2 else "INFO"
    level = os.environ.get("STREAMRFT_LOG_LEVEL", default).upper()
    logging.basicConfig(
        level=level,
        format="%(name)s: %(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],  # stdout stays for data
        force=True,
    )
