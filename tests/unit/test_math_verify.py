r"""``reward_fn: math_verify``: answers equal but written differently score 1, different ones 0, in the child
process that keeps its time, called off the main thread as the rollout core calls it."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify", reason="math-verify is not installed: pip install 'streamrft[math]'")

from streamrft.engines.tasks import make_fraction_word_problems  # noqa: E402
from streamrft.engines.workflows import get_reward, reward_names  # noqa: E402
from streamrft.engines.workflows.math_verify import Verifier, equivalent  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"

EQUAL = [
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}."),
    ("\\frac{1}{2}", "So half of it: 1/2"),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("1/2", "\\boxed{\\dfrac{1}{2}}"),
    ("2", "Solving, x = 2"),
    ("2", "$x=2$"),
    (2, "so the result is \\boxed{2}."),
    ("\\frac{5}{8}", "\\boxed{\\frac{10}{16}}"),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}"),
    (277, "There are 277 muffins left."),
]
DIFFERENT = [
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("0.5", "The answer is 5."),
    ("2", "x = 3"),
    ("3", "The answer is 30"),
    ("\\frac{5}{8}", "\\boxed{\\frac{8}{5}}"),
    ("1/2", "I do not know."),
    ("1/2", ""),
]


@pytest.fixture(scope="module")
def reward():
    assert "math_verify" in reward_names()
    return get_reward("math_verify")


@pytest.mark.parametrize("gold, response", EQUAL)
def test_equal_answers_written_differently_score_one(reward, gold, response):
    scored = reward(response, {"answer": gold})
    assert (scored.value, scored.correct) == (1.0, True)
    assert scored.metrics == {"reward/math_verify_timeout": 0.0}


@pytest.mark.parametrize("gold, response", DIFFERENT)
def test_different_answers_score_zero(reward, gold, response):
    scored = reward(response, {"answer": gold})
    assert (scored.value, scored.correct) == (0.0, False)


def test_a_task_without_an_answer_is_a_task_error(reward):
    with pytest.raises(KeyError, match="answer"):
        reward("\\boxed{1}", {"question": "?"})


def test_off_the_main_thread(reward):
    """The rollout core's thread: math-verify's own signal timeouts would raise ValueError there."""
    out = []
    thread = threading.Thread(target=lambda: out.append(reward("\\boxed{\\frac{1}{2}}", {"answer": "0.5"})))
    thread.start()
    thread.join(30)
    assert out and out[0].correct


def test_an_answer_over_the_time_limit_scores_zero_and_the_next_one_is_checked():
    verifier = Verifier(time_limit_s=0.0)  # every answer is "too slow": the child is killed and restarted
    try:
        assert verifier.check("1", "\\boxed{1}") is True  # the first call's limit covers the child's start
        process = verifier._process
        assert verifier.check("1", "\\boxed{1}") is None
        assert process.poll() is not None  # killed
        verifier.time_limit_s = 10.0
        started = time.monotonic()
        assert verifier.check("\\frac{3}{4}", "0.75") is True  # a fresh child
        assert time.monotonic() - started < 30
    finally:
        verifier.close()


def test_the_shipped_fraction_word_problems_verify_against_their_own_answers(reward):
    """Every row's answer is LaTeX that math-verify reads, and its decimal and plain forms score 1."""
    rows = [json.loads(line) for line in (EXAMPLES / "fraction_word_problems_eval.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and any("\\frac" in row["answer"] for row in rows)
    tasks = make_fraction_word_problems(64, seed=2, taskset="fraction_word_problems_eval")
    assert [json.loads(t.payload)["answer"] for t in tasks] == [row["answer"] for row in rows]
    assert {t.reward_fn for t in tasks} == {"math_verify"} and {t.workflow for t in tasks} == {"math_boxed"}
    for row in rows[:12]:
        assert equivalent(row["answer"], f"\\boxed{{{row['answer']}}}")
        plain = row["answer"].replace("\\frac{", "").replace("}{", "/").rstrip("}")
        assert reward(f"The answer is {plain}", row).correct, row
