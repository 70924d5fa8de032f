#!/usr/bin/env python3
"""Figures on the code's structure, read with ast (nothing is imported), to compare a refactoring before and
after with the same tool; ``tests/unit/test_structure.py`` holds the code to their limits:

- the largest classes (lines, methods, attributes assigned on ``self``) and functions (lines);
- the places that interpret a policy by its name outside the policy's one home: a sync style (comparisons with
  a ``sync_style`` attribute, a ``SyncStyle`` member or a style name: "fixed", "trainer_driven", "fully_async";
  home ``streamrft/pacing.py``) and a run's mode (comparisons of a ``mode`` with "both", "explore" or "train";
  home: the module that defines ``RunShape``). ``schemas/`` is left out (Avro has a type named "fixed").

    .venv/bin/python scripts/structure_report.py [--top 10]
"""
from __future__ import annotations

import argparse
import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the folders installed as packages (pyproject.toml holds the one map)
FOLDERS = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["streamrft"]["package-folders"].values())
STYLE_NAMES = {"fixed", "trainer_driven", "fully_async"}
MODE_NAMES = {"both", "explore", "train"}


@dataclass(frozen=True)
class Definition:
    kind: str  # "class" or "function"
    place: str  # "path:Name"
    lines: int
    methods: int = 0
    attributes: int = 0


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def definitions(path: Path):
    """Every class (lines, methods, ``self`` attributes) and function (lines) of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = _relative(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attributes = {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                          for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            yield Definition("class", f"{rel}:{node.name}", _span(node), len(methods), len(attributes))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield Definition("function", f"{rel}:{node.name}", _span(node))


def _names_a_style(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in STYLE_NAMES:
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_style(e) for e in node.elts)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "SyncStyle":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "sync_style"


def _is_mode(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "mode") or (isinstance(node, ast.Name)
                                                                       and node.id == "mode")


def _names_a_mode(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in MODE_NAMES:
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_mode(e) for e in node.elts)


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def _comparisons(path: Path, matches) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    rel = _relative(path)
    return [f"{rel}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Compare) and matches(node)]


def style_interpretations(path: Path) -> list[str]:
    """Comparisons (==, !=, in) that look at a sync style's name."""
    return _comparisons(path, lambda node: any(_names_a_style(part) for part in (node.left, *node.comparators)))


def mode_interpretations(path: Path) -> list[str]:
    """Comparisons that look at a run mode's name: a ``mode`` against "both", "explore" or "train"."""
    def matches(node: ast.Compare) -> bool:
        parts = (node.left, *node.comparators)
        return any(_is_mode(p) for p in parts) and any(_names_a_mode(p) for p in parts)

    return _comparisons(path, matches)


def _defines(path: Path, class_name: str) -> bool:
    return any(isinstance(n, ast.ClassDef) and n.name == class_name for n in ast.walk(ast.parse(path.read_text())))


def policy_places() -> dict[str, tuple[list[str], list[str]]]:
    """For the sync style and the run mode: (comparisons in the policy's home, comparisons elsewhere)."""
    code = [path for path in sources() if path.parts[-2] != "schemas"]
    homes = {"sync style": [ROOT / "streamrft" / "pacing.py"],
             "run mode": [path for path in code if _defines(path, "RunShape")]}
    finders = {"sync style": style_interpretations, "run mode": mode_interpretations}
    out = {}
    for policy, find in finders.items():
        home = [place for path in code if path in homes[policy] for place in find(path)]
        elsewhere = [place for path in code if path not in homes[policy] for place in find(path)]
        out[policy] = (home, elsewhere)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    rows = [row for path in sources() for row in definitions(path)]
    print(f"largest classes (lines, methods, self attributes), top {args.top}:")
    for row in sorted((r for r in rows if r.kind == "class"), key=lambda r: -r.lines)[: args.top]:
        print(f"  {row.lines:5d} {row.methods:3d} {row.attributes:3d}  {row.place}")
    print(f"largest functions (lines), top {args.top}:")
    for row in sorted((r for r in rows if r.kind == "function"), key=lambda r: -r.lines)[: args.top]:
        print(f"  {row.lines:5d}  {row.place}")
    for policy, (home, elsewhere) in policy_places().items():
        files = sorted({place.split(":")[0] for place in elsewhere})
        print(f"{policy} interpreted outside its home: {len(elsewhere)} comparison(s) in {len(files)} file(s); "
              f"in its home: {len(home)}")
        for place in elsewhere:
            print(f"  {place}")


if __name__ == "__main__":
    main()
