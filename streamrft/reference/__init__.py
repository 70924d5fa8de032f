"""The generated reference pages of the docs: each is a module of this package with ``PATH`` (the page, relative
to the repository root) and ``render()`` (its text, the same for the same code). ``python -m streamrft.reference``
writes them; ``--check`` says which are out of date. Nothing here imports torch or a Kafka client."""
from __future__ import annotations

# the page modules, by name: each is imported when the pages are made, so one not written yet is skipped
PAGES: tuple[str, ...] = ("config_page", "cli_page", "metrics_page")
COMMAND = "python -m streamrft.reference"
