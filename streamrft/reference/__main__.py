"""``python -m streamrft.reference [--check] [--root DIR]``: write every page of :data:`streamrft.reference.PAGES`,
or with ``--check`` exit 1 naming the pages that differ from what their module renders."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from types import ModuleType

from . import COMMAND, PAGES

logger = logging.getLogger(__name__)
CHECKOUT = Path(__file__).resolve().parents[2]  # streamrft/reference/__main__.py -> the repository root


def page_modules(names: tuple[str, ...] = PAGES) -> list[ModuleType]:
    """The page modules that exist, in order; a missing one is skipped with a warning (its page keeps whatever
    is on disk)."""
    modules = []
    for name in names:
        qualified = f"{__package__}.{name}"
        try:
            modules.append(importlib.import_module(qualified))
        except ModuleNotFoundError as exc:
            if exc.name != qualified:
                raise  # the page module is there, and something it imports is not
            logger.warning("no page module %s: its page is skipped", qualified)
    return modules


def stale_pages(root: Path, modules: list[ModuleType]) -> list[str]:
    """The paths (relative to ``root``) whose text is not what their module renders, or which do not exist."""
    stale = []
    for module in modules:
        path = root / module.PATH
        if not path.is_file() or path.read_text(encoding="utf-8") != module.render():
            stale.append(module.PATH)
    return stale


def write_pages(root: Path, modules: list[ModuleType]) -> list[str]:
    """Render every page to its path; the paths whose text changed."""
    changed = []
    for module in modules:
        path = root / module.PATH
        text = module.render()
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(module.PATH)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="write the generated reference pages of the docs")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each page that is out of date")
    parser.add_argument("--root", type=Path, default=CHECKOUT,
                        help="the repository whose docs/ to write (default: the checkout this package is in)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    modules = page_modules()
    if args.check:
        stale = stale_pages(args.root, modules)
        for path in stale:
            print(f"{path} is out of date", file=sys.stderr)
        if stale:
            print(f"regenerate with: {COMMAND}", file=sys.stderr)
            return 1
        print(f"{len(modules)} page(s) up to date")
        return 0
    changed = write_pages(args.root, modules)
    for path in changed:
        print(f"wrote {path}")
    print(f"{len(modules)} page(s), {len(changed)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
