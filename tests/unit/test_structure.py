"""The code's structure held to its limits, with the figures of ``scripts/structure_report.py`` (read with ast,
nothing imported): no class over 300 lines, and each policy interpreted by its name only in its one home (the sync
style in ``streamrft/pacing.py``, the run mode in ``RunShape``). Import circles: ``test_layering.py``."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CLASS_LINES = 300

_spec = importlib.util.spec_from_file_location("structure_report", ROOT / "scripts" / "structure_report.py")
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # dataclasses look their module up there
_spec.loader.exec_module(report)


def test_the_report_reads_the_code():
    classes = [d for path in report.sources() for d in report.definitions(path) if d.kind == "class"]
    assert len(classes) > 100 and any(d.place.endswith(":RunConfig") for d in classes)


def test_no_class_is_over_300_lines():
    over = [f"{d.place}: {d.lines} lines" for path in report.sources() for d in report.definitions(path)
            if d.kind == "class" and d.lines > MAX_CLASS_LINES]
    assert over == [], "split the class: give each of its jobs a class of its own"


def test_each_policy_is_interpreted_in_its_home_only():
    places = report.policy_places()
    assert {policy: elsewhere for policy, (_, elsewhere) in places.items()} == {"sync style": [], "run mode": []}
    assert places["sync style"][0], "the sync style's home interprets it"


def test_the_finders_see_a_comparison(tmp_path: Path):
    path = tmp_path / "x.py"
    path.write_text("if config.mode == 'train':\n    pass\nif style in ('fixed', 'other'):\n    pass\n"
                    "if mode != 'sasl_scram_tls':\n    pass\n")
    assert [p.rsplit(":", 1)[1] for p in report.mode_interpretations(path)] == ["1"]
    assert [p.rsplit(":", 1)[1] for p in report.style_interpretations(path)] == ["3"]
