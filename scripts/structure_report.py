#!/usr/bin/env python3
"""Figures on the code's structure, read with ast (nothing is imported), to compare a refactoring before and
after with the same tool:

- the largest classes (lines, methods, attributes assigned on ``self``) and functions (lines);
- the places that interpret a sync style: comparisons against a ``sync_style`` attribute, a ``SyncStyle`` member
  or one of the style names ("fixed", "trainer_driven", "fully_async"); ``streamrft/pacing.py``, the policy's one
  home, is counted apart. ``schemas/`` is left out (Avro has a type named "fixed").

    .venv/bin/python scripts/structure_report.py [--top 10]
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("streamrft", "schemas", "producers", "consumers", "engines")
STYLE_NAMES = {"fixed", "trainer_driven", "fully_async"}


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def classes_and_functions(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).as_posix()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attributes = {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                          for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            yield "class", f"{rel}:{node.name}", span(node), len(methods), len(attributes)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "function", f"{rel}:{node.name}", span(node), 0, 0


def _names_a_style(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in STYLE_NAMES:
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_style(e) for e in node.elts)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "SyncStyle":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "sync_style"


def style_interpretations(path: Path) -> list[str]:
    """Comparisons (==, !=, in) that look at a sync style's name."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(_names_a_style(part) for part in (node.left, *node.comparators))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    rows = [row for path in sources() for row in classes_and_functions(path)]
    print(f"largest classes (lines, methods, self attributes), top {args.top}:")
    for _, name, lines, methods, attributes in sorted((r for r in rows if r[0] == "class"),
                                                      key=lambda r: -r[2])[: args.top]:
        print(f"  {lines:5d} {methods:3d} {attributes:3d}  {name}")
    print(f"largest functions (lines), top {args.top}:")
    for _, name, lines, _, _ in sorted((r for r in rows if r[0] == "function"), key=lambda r: -r[2])[: args.top]:
        print(f"  {lines:5d}  {name}")
    places = [place for path in sources() if path.parts[-2] != "schemas" for place in style_interpretations(path)]
    home = [p for p in places if p.startswith("streamrft/pacing.py:")]
    elsewhere = [p for p in places if p not in home]
    files = sorted({place.split(":")[0] for place in elsewhere})
    print(f"sync style interpreted outside streamrft/pacing.py: {len(elsewhere)} comparison(s) in {len(files)} "
          f"file(s); in streamrft/pacing.py: {len(home)}")
    for place in elsewhere:
        print(f"  {place}")


if __name__ == "__main__":
    main()
