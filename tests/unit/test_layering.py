"""The layering rules (docs/architecture.md, "Layers"), checked on what each module really imports, transitively:
the source files are read with ast (nothing is imported) into a graph of our modules, and a rule fails with the
chain of imports that breaks it.

- ``schemas/`` imports nothing of ours outside itself;
- the torch-free core: ``streamrft.kafka``, ``streamrft.config``, ``streamrft.broker``, ``schemas/``,
  ``producers/`` and the engines' settings and algorithm registries load no torch (nor transformers or vLLM) and
  no training or inference engine, so a Kafka helper, a config check or a ``--help`` never pays for them (checked
  here on the sources, and once more on a real interpreter's ``sys.modules``);
- no import circles: no module reaches itself through the imports of others (``TYPE_CHECKING`` imports count
  here: a circle of types is a circle of design);
- ``engines/`` imports no Kafka (``confluent_kafka``, ``streamrft.kafka``, ``streamrft.broker``), no config, no
  roles, no producers;
- only ``streamrft/kafka/`` and ``streamrft/broker/`` import ``confluent_kafka`` (``bench/`` included: a
  benchmark's raw baseline clients come from the client layer);
- the core (``streamrft/`` but its entry points: the CLI, ``commands/``, ``launch/``) imports no role;
- ``producers/`` import no ``consumers/``;
- an import that crosses top-level folders is absolute.

What counts as an import: ``import x``, ``from x import y`` (``y`` itself when it is a module: ``from streamrft
import kafka``), imports inside functions (they run when the function does), ``importlib.import_module("x")`` and
``__import__("x")`` with a literal name, and the packages above an imported module (their ``__init__`` runs
first). Imports under ``if TYPE_CHECKING:`` do not run and do not count.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# top-level folder -> the package it is installed as (pyproject.toml's one map); bench/ scripts are modules of
# their own
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["streamrft"]["package-folders"]
FOLDERS = {folder: package for package, folder in PACKAGES.items()} | {"bench": "bench"}
KAFKA = ("confluent_kafka", "streamrft.kafka", "streamrft.broker")
TORCH_FREE = ("streamrft.kafka", "streamrft.config", "streamrft.broker", "streamrft.schemas", "streamrft.producers",
              "streamrft.validation", "streamrft.engines.settings", "streamrft.engines.algorithms.catalog",
              "streamrft.engines.weights.locations", "streamrft.engines.weights.signal_state",
              "streamrft.metric_catalog", "streamrft.reference")
HEAVY = ("torch", "transformers", "vllm", "streamrft.engines.training", "streamrft.engines.inference")
ENTRY_POINTS = ("streamrft.cli", "streamrft.commands", "streamrft.launch")


def is_under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@dataclass(frozen=True)
class Import:
    line: int
    target: str
    relative: bool
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: never runs, but still ties the two modules
    of_submodule: bool = False  # ``from package import module``: the package line of a submodule's import


@dataclass
class ImportGraph:
    """Our modules (name -> file) and what each imports (``Import`` s, targets resolved to absolute names)."""

    root: Path
    folders: dict[str, str]
    files: dict[str, Path] = field(default_factory=dict)
    packages: set[str] = field(default_factory=set)
    imports: dict[str, list[Import]] = field(default_factory=dict)

    @classmethod
    def of(cls, root: Path, folders: dict[str, str]) -> "ImportGraph":
        graph = cls(root, folders)
        for folder, package in folders.items():
            for path in sorted((root / folder).rglob("*.py")):
                name, is_package = graph._module_name(path)
                graph.files[name] = path
                if is_package:
                    graph.packages.add(name)
        for name, path in graph.files.items():
            graph.imports[name] = graph._imports_of(name, path)
        return graph

    def _module_name(self, path: Path) -> tuple[str, bool]:
        rel = path.relative_to(self.root).with_suffix("")
        parts = [*self.folders[rel.parts[0]].split("."), *rel.parts[1:]]
        is_package = parts[-1] == "__init__"
        return ".".join(parts[:-1] if is_package else parts), is_package

    def folder_of(self, module: str) -> str | None:
        """The top-level folder that holds ``module`` (the longest matching package wins)."""
        matches = [f for f, pkg in self.folders.items() if is_under(module, pkg)]
        return max(matches, key=lambda f: len(self.folders[f]), default=None)

    def _imports_of(self, name: str, path: Path) -> list[Import]:
        package = name if name in self.packages else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        typing = {id(n) for node in ast.walk(tree) if _is_type_checking_block(node)
                  for child in node.body for n in ast.walk(child)}
        out: list[Import] = []
        for node in ast.walk(tree):
            typing_only = id(node) in typing
            if isinstance(node, ast.Import):
                out += [Import(node.lineno, alias.name, False, typing_only) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                # `from streamrft import kafka`: the submodule is what is imported
                submodules = [Import(node.lineno, f"{base}.{alias.name}", bool(node.level), typing_only)
                              for alias in node.names if f"{base}.{alias.name}" in self.files]
                out.append(Import(node.lineno, base, bool(node.level), typing_only,
                                  of_submodule=len(submodules) == len(node.names)))
                out += submodules
            elif isinstance(node, ast.Call) and _is_dynamic_import(node):
                out.append(Import(node.lineno, node.args[0].value, False, typing_only))
        return out

    def edges(self, module: str) -> list[tuple[int, str]]:
        """(line, module) for each module loaded when ``module`` runs: its imports and their parent packages."""
        out = []
        for imp in self.imports.get(module, []):
            if imp.typing_only:
                continue
            parts = imp.target.split(".")
            out += [(imp.line, ".".join(parts[:i])) for i in range(1, len(parts) + 1)]
        return out

    def chain_to(self, start: str, forbidden) -> list[str] | None:
        """The shortest chain of imports from ``start`` to a module ``forbidden(module)`` holds for, or None."""
        seen = {start}
        queue = deque([(start, [start])])
        while queue:
            module, path = queue.popleft()
            for line, target in self.edges(module):
                if target in seen:
                    continue
                seen.add(target)
                step = [*path[:-1], f"{path[-1]}:{line}", target]
                if forbidden(target):
                    return step
                if target in self.files:
                    queue.append((target, step))
        return None

    def circles(self) -> list[list[str]]:
        """The import circles among our modules (each a strongly connected set of modules, sorted): a module's
        imports here are what it names, ``TYPE_CHECKING`` ones included, not the packages above them (loading a
        package first is Python's doing, not a tie the code made)."""
        ties = {module: sorted({imp.target for imp in imports if imp.target in self.files and imp.target != module
                                and not imp.of_submodule})
                for module, imports in self.imports.items()}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        found: list[list[str]] = []

        def visit(module: str) -> None:  # Tarjan's strongly connected components
            index[module] = low[module] = len(index)
            stack.append(module)
            for target in ties[module]:
                if target not in index:
                    visit(target)
                    low[module] = min(low[module], low[target])
                elif target in stack:
                    low[module] = min(low[module], index[target])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

        for module in sorted(ties):
            if module not in index:
                visit(module)
        return sorted(found)

    def violations(self, scope, forbidden) -> list[str]:
        """For each of our modules in ``scope`` that reaches a forbidden one: the chain, as text."""
        found = []
        for module in sorted(self.files):
            if scope(module):
                chain = self.chain_to(module, forbidden)
                if chain is not None:
                    found.append(" -> ".join(chain))
        return found


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
    return named and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)


# -- the rules, on this repository -------------------------------------------------------------------------
GRAPH = ImportGraph.of(ROOT, FOLDERS)


def test_the_graph_holds_the_code():
    assert len(GRAPH.files) > 80 and "streamrft.consumers.trainer" in GRAPH.files
    assert "streamrft.kafka" in GRAPH.packages and any(is_under(m, "bench") for m in GRAPH.files)
    assert GRAPH.chain_to("streamrft.consumers.trainer", lambda m: m == "confluent_kafka") is not None


def test_schemas_import_nothing_of_ours():
    assert GRAPH.violations(lambda m: is_under(m, "streamrft.schemas"),
                            lambda m: is_under(m, "streamrft", "bench") and not is_under(m, "streamrft.schemas")
                            and m != "streamrft") == []


def test_engines_have_no_kafka_no_config_and_no_roles():
    assert GRAPH.violations(lambda m: is_under(m, "streamrft.engines"),
                            lambda m: is_under(m, *KAFKA, "streamrft.config", "streamrft.consumers",
                                               "streamrft.producers")) == []


def test_only_the_kafka_layer_imports_confluent_kafka():
    allowed = ("streamrft.kafka", "streamrft.broker")
    direct = [f"{module}:{imp.line}: {imp.target}" for module, imports in sorted(GRAPH.imports.items())
              if not is_under(module, *allowed) for imp in imports if is_under(imp.target, "confluent_kafka")]
    assert direct == [], "import it through streamrft.kafka (raw baseline clients: streamrft.kafka.raw)"


def test_the_core_imports_no_role():
    core = lambda m: is_under(m, "streamrft") and not is_under(m, *ENTRY_POINTS, "streamrft.consumers",  # noqa: E731
                                                                "streamrft.producers", "streamrft.schemas",
                                                                "streamrft.engines")
    assert GRAPH.violations(core, lambda m: is_under(m, "streamrft.consumers")) == []


def test_the_core_loads_no_torch():
    assert GRAPH.violations(lambda m: is_under(m, *TORCH_FREE), lambda m: is_under(m, *HEAVY)) == [], (
        "move what needs torch out of the torch-free core (settings models: streamrft/engines/settings/), or "
        "import it where it is used, in an engine or a role")


def test_the_core_loads_no_torch_in_a_real_interpreter():
    """What the sources say, checked once more on what Python loads: every torch-free package, and a run's config
    with every section set."""
    modules = [m for m in sorted(GRAPH.files) if is_under(m, *TORCH_FREE)]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "from streamrft.config import load_config\n"
            f"load_config({str(ROOT / 'examples' / 'arithmetic.yaml')!r})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm')"
            f" or m.startswith({HEAVY[3:]!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_no_import_circles():
    assert GRAPH.circles() == [], "modules that import each other: give one of them what it needs instead"


def test_producers_import_no_consumers():
    assert GRAPH.violations(lambda m: is_under(m, "streamrft.producers"),
                            lambda m: is_under(m, "streamrft.consumers")) == []


def test_imports_across_folders_are_absolute():
    found = [f"{module}:{imp.line}: {imp.target}" for module, imports in sorted(GRAPH.imports.items())
             for imp in imports if imp.relative and GRAPH.folder_of(imp.target) != GRAPH.folder_of(module)]
    assert found == [], "write an import into another top-level folder as `from streamrft.<folder> import ...`"


# -- the checker itself: the tricks a file-by-file reading missed are caught ---------------------------------
TRICKS = {
    "streamrft/__init__.py": "",
    "streamrft/kafka/__init__.py": "import confluent_kafka\n",
    "streamrft/sync.py": "from streamrft.kafka import KafkaClients\n",
    "streamrft/pacing.py": "X = 1\n",
    "engines/__init__.py": "",
    "engines/by_package.py": "from streamrft import kafka\n",
    "engines/through_sync.py": "def later():\n    from streamrft.sync import SyncView\n",
    "engines/by_name.py": "import importlib\nclient = importlib.import_module('confluent_kafka')\n",
    "engines/fine.py": "from typing import TYPE_CHECKING\nfrom streamrft import pacing\n"
                       "if TYPE_CHECKING:\n    from streamrft.kafka import KafkaClients\n",
}


@pytest.fixture
def tricky_graph(tmp_path: Path) -> ImportGraph:
    for name, text in TRICKS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return ImportGraph.of(tmp_path, {"streamrft": "streamrft", "engines": "streamrft.engines"})


def test_each_trick_is_caught_with_its_chain(tricky_graph: ImportGraph):
    found = tricky_graph.violations(lambda m: is_under(m, "streamrft.engines"), lambda m: is_under(m, *KAFKA))
    assert found == [
        "streamrft.engines.by_name:2 -> confluent_kafka",
        "streamrft.engines.by_package:1 -> streamrft.kafka",
        "streamrft.engines.through_sync:2 -> streamrft.sync:1 -> streamrft.kafka",
    ]  # fine.py: pacing is allowed and its TYPE_CHECKING import never runs


def test_circles_are_found_through_type_checking_imports(tmp_path: Path):
    files = {"__init__.py": "", "a.py": "from .b import B\n",
             "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
             "c.py": "from . import a\n"}
    (tmp_path / "engines").mkdir()
    for name, text in files.items():
        (tmp_path / "engines" / name).write_text(text)
    graph = ImportGraph.of(tmp_path, {"engines": "streamrft.engines"})
    assert graph.circles() == [["streamrft.engines.a", "streamrft.engines.b"]]
    assert graph.chain_to("streamrft.engines.b", lambda m: m == "streamrft.engines.a") is None  # never runs


def test_relative_imports_resolve_the_way_python_does(tmp_path: Path):
    (tmp_path / "consumers").mkdir()
    (tmp_path / "consumers" / "__init__.py").write_text("")
    (tmp_path / "consumers" / "rollout.py").write_text("from ..kafka import X\nfrom .dlq import Y\n")
    graph = ImportGraph.of(tmp_path, {"consumers": "streamrft.consumers"})
    assert [imp.target for imp in graph.imports["streamrft.consumers.rollout"]] == [
        "streamrft.kafka", "streamrft.consumers.dlq"]
