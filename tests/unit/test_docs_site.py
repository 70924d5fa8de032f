"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link or anchor fails it, see
``validation`` in mkdocs.yml), the README stays a short guide whose relative links all resolve, and the topics
reference names every topic the code declares."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed: install them with `scripts/setup.sh --dev` (the docs extra)")


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, not a problem
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


@needs_mkdocs
def test_the_site_builds_strict(tmp_path: Path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    site = tmp_path / "site"
    for page in ("index.html", "getting-started/index.html", "reference/configuration/index.html",
                 "architecture/index.html", "assets/roles-and-topics.svg"):
        assert (site / page).is_file(), f"the built site has no {page}"
    assert "roles-and-topics.svg" in (site / "index.html").read_text()


@needs_mkdocs
def test_a_broken_anchor_fails_the_strict_build(tmp_path: Path):
    # the same site with one link to an anchor no page has: validation.anchors must make --strict fail on it
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "index.md", "a") as index:
        index.write("\nSee [pacing](concepts/pacing.md#no-such-section).\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-section" in done.stdout + done.stderr


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move the detail into a page under docs/"


def test_every_relative_link_of_the_readme_resolves():
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    relative = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert len(relative) > 20  # the picture and the links into docs/
    missing = [t for t in relative if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_the_readme_keeps_the_two_commands():
    # .ci/run runs the README's test command as written there
    text = README.read_text()
    assert "\nscripts/setup.sh --demo && .venv/bin/streamrft run examples/arithmetic.yaml\n" in text
    assert "\nscripts/test.sh\n" in text
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_topics_reference_names_every_topic():
    from streamrft.config.topics import TOPIC_KINDS

    page = (ROOT / "docs" / "reference" / "topics.md").read_text()
    missing = [kind.name for kind in TOPIC_KINDS if f"| `{kind.name}` | `{kind.record.__name__}` |" not in page]
    assert missing == [], f"docs/reference/topics.md has no row for {missing}"
