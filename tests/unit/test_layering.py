"""The layering rules of DESIGN.md, read from the source files with ast (nothing is imported):

- ``engines/`` imports no Kafka: not ``confluent_kafka``, not ``streamrft.kafka``, not ``streamrft.consumers``;
- ``schemas/`` imports nothing of ours outside itself;
- only ``streamrft/kafka/`` and ``streamrft/broker/`` import ``confluent_kafka``;
- an import that crosses top-level folders is absolute (a relative one cannot be followed on disk without the
  package-dir mapping).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# top-level folder -> the package it is installed as (setup.py)
FOLDERS = {"streamrft": "streamrft", "schemas": "streamrft.schemas", "producers": "streamrft.producers",
           "consumers": "streamrft.consumers", "engines": "streamrft.engines"}


def module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def folder_of(module: str) -> str | None:
    """The top-level folder that holds ``module`` (the longest matching package wins)."""
    matches = [f for f, pkg in FOLDERS.items() if module == pkg or module.startswith(pkg + ".")]
    return max(matches, key=lambda f: len(FOLDERS[f]), default=None)


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, absolute module name, written relative) for every import in the file, nested ones included."""
    name, is_package = module_name(path)
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                out.append((node.lineno, target, True))
            else:
                out.append((node.lineno, node.module or "", False))
    return out


SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def violations(rule) -> list[str]:
    found = []
    for path in SOURCES:
        folder = path.relative_to(ROOT).parts[0]
        for line, module, relative in imports(path):
            why = rule(path, folder, module, relative)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line}: {module}: {why}")
    return found


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_sources_found():
    assert len(SOURCES) > 50 and any(p.name == "trainer.py" for p in SOURCES)


def test_engines_have_no_kafka():
    def rule(path, folder, module, relative):
        if folder == "engines" and any(is_under(module, p) for p in
                                       ("confluent_kafka", "streamrft.kafka", "streamrft.consumers",
                                        "streamrft.broker", "streamrft.producers")):
            return "engines/ must not depend on Kafka or the roles"
    assert violations(rule) == []


def test_schemas_import_nothing_of_ours():
    def rule(path, folder, module, relative):
        if folder == "schemas" and is_under(module, "streamrft") and not is_under(module, "streamrft.schemas"):
            return "schemas/ is the contract and imports nothing else of streamrft"
    assert violations(rule) == []


def test_only_the_kafka_layer_imports_confluent_kafka():
    allowed = ("streamrft/kafka/", "streamrft/broker/")

    def rule(path, folder, module, relative):
        rel = path.relative_to(ROOT).as_posix()
        if is_under(module, "confluent_kafka") and not rel.startswith(allowed):
            return "only streamrft/kafka/ and streamrft/broker/ may import confluent_kafka"
    assert violations(rule) == []


def test_imports_across_folders_are_absolute():
    def rule(path, folder, module, relative):
        if relative and folder_of(module) != folder:
            return f"relative import into {folder_of(module)}/; write it as `from {module} import ...`"
    assert violations(rule) == []


@pytest.mark.parametrize("text,expected", [
    ("from ..kafka import X\n", "streamrft.kafka"),
    ("from .dlq import X\n", "streamrft.consumers.dlq"),
])
def test_relative_imports_resolve(tmp_path, text, expected, monkeypatch):
    """The resolver itself: a relative import inside consumers/ resolves the way Python would."""
    fake = ROOT / "consumers" / "rollout.py"
    monkeypatch.setattr(Path, "read_text", lambda self: text)
    assert imports(fake)[0][1] == expected
