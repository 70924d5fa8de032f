"""How tests/interop finds its toolchains and reuses its builds, without a broker: a missing or too old Go or JDK
is a skip whose reason says what to install; a build is kept by the digest of its sources."""
from __future__ import annotations

from pathlib import Path

import pytest

from . import toolchains
from .toolchains import ToolchainMissing


def test_a_missing_toolchain_says_what_to_install(monkeypatch):
    monkeypatch.setattr(toolchains.shutil, "which", lambda name: None)
    monkeypatch.setattr(toolchains.os, "access", lambda path, mode: False)
    with pytest.raises(ToolchainMissing, match=r"Go is not installed .*Go 1\.26\+"):
        toolchains.build_go()
    with pytest.raises(ToolchainMissing, match=r"JDK is not installed .*openjdk-17-jdk-headless"):
        toolchains.build_java()
    monkeypatch.setattr(toolchains.shutil, "which", lambda name: None if name == "mvn" else f"/usr/bin/{name}")
    with pytest.raises(ToolchainMissing, match="Maven is not installed"):
        toolchains.build_java()


def test_a_go_older_than_the_modules_need_is_a_missing_toolchain(monkeypatch):
    monkeypatch.setattr(toolchains.shutil, "which", lambda name: "/usr/bin/go")
    monkeypatch.setattr(toolchains, "_run", lambda args, what, **kwargs: "go1.22.4\n")
    with pytest.raises(ToolchainMissing, match=r"Go 1\.26\+ is needed for the Go client, found go1\.22\.4"):
        toolchains.build_go()


def test_a_build_is_reused_until_a_source_changes(tmp_path: Path):
    (tmp_path / "main.go").write_text("package main\n")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "classes.txt").write_text("build output")
    first = toolchains._digest(tmp_path)
    (tmp_path / "target" / "classes.txt").write_text("another build output")
    assert toolchains._digest(tmp_path) == first
    (tmp_path / "main.go").write_text("package main // changed\n")
    assert toolchains._digest(tmp_path) != first
