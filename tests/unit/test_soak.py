"""bench/soak.py's bookkeeping (no run): each role's lives and their memory, the launcher's restart count read
back, and the checks that the soak adds to chaos.py's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(BENCH))
    try:
        import soak as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_each_role_keeps_its_longest_life_and_reads_memory_after_warmup(soak):
    ledger = soak.MemoryLedger()
    for t in range(0, 700, 100):  # trainer pid 10 from 0 to 600 s, growing 1 MiB a sample
        ledger.sample(t, {"trainer": (10, 100 * 2**20 + t // 100 * 2**20)})
    for t in range(700, 900, 100):  # killed, pid 11 lives 100 s
        ledger.sample(t, {"trainer": (11, 50 * 2**20)})
    life = ledger.longest("trainer")
    assert (life.pid, life.duration_s(), ledger.lives_of("trainer")) == (10, 600, 2)
    assert life.rss_after(150) == 102 * 2**20  # the first sample at least 150 s into the life: t=200
    assert life.rss_end() == 106 * 2**20
    assert soak.growth(life.rss_after(150), life.rss_end()) == pytest.approx(4 / 102)
    assert soak.growth(None, 5) is None


def test_role_names_follow_the_launcher(soak):
    assert soak.role_name(["python", "-m", "streamrft.cli", "train", "run.yaml"]) == "trainer"
    assert soak.role_name(["python", "-m", "streamrft.cli", "rollout", "r.yaml", "--worker-id", "rollout-2"]) == \
        "rollout-2"
    assert soak.role_name(["python", "-m", "streamrft.cli", "monitor", "r.yaml"]) == "monitor"
    assert soak.role_name(["java", "-cp", "x"]) is None


def test_restarts_are_read_from_the_launchers_last_line(soak, tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text("started explorer\nrestarts: explorer 2, rollout-0 1, trainer 3\nreport: x\n")
    assert soak._restarts_from_log(log) == {"explorer": 2, "rollout-0": 1, "trainer": 3}


def test_a_gap_in_the_trainers_steps_and_a_kill_without_restart_fail(soak):
    chaos = sys.modules["chaos"]
    verdict = chaos.Verdict()
    soak._check_contiguous([{"step": 0}, {"step": 1}, {"step": 3}], verdict)
    soak._check_restarts({"trainer": 2, "monitor": 1}, {"trainer": 2, "explorer": 1}, verdict)
    assert verdict.violations == {"trainer steps not contiguous": ["[0, 1, 3]"],
                                  "kills and restarts differ": ["explorer: killed 0, restarted 1",
                                                                "monitor: killed 1, restarted 0"]}
    fine = chaos.Verdict()
    soak._check_contiguous([{"step": 0}, {"step": 1}], fine)
    soak._check_restarts({"trainer": 1}, {"trainer": 1, "monitor": 0}, fine)
    assert fine.ok and fine.figures["trainer steps"] == "0..1"
