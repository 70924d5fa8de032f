"""Task sets built in code (no Kafka): the arithmetic demo taskset, word problems for the calculator tool, and
word problems with fraction answers for ``reward_fn: math_verify``."""
from __future__ import annotations

import json
import random
from fractions import Fraction

from streamrft.schemas import Task


def make_arithmetic_tasks(
    n: int,
    seed: int = 0,
    low: int = 1,
    high: int = 20,
    *,
    taskset: str = "arithmetic",
    repeat_times: int | None = None,
) -> list[Task]:
    """``n`` tasks "What is a + b?" with ``a, b`` drawn uniformly from ``[low, high]`` (same seed, same tasks).
    Payload ``{"question", "answer"}``; workflow ``arithmetic``; ids ``<taskset>-<seed>-<i>``."""
    if low > high:
        raise ValueError(f"low ({low}) must be <= high ({high})")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        tasks.append(
            Task(
                task_id=f"{taskset}-{seed}-{i}",
                workflow="arithmetic",
                payload=json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}),
                taskset=taskset,
                repeat_times=repeat_times,
            )
        )
    return tasks


# (question template, answer) pairs: numbers a, b, c are drawn per task; every answer is a whole number >= 0.
_WORD_PROBLEMS = (
    ("A baker fills {a} trays with {b} muffins each and sells {c} muffins. How many muffins are left?",
     lambda a, b, c: a * b - c),
    ("A library has {a} shelves of {b} books. It buys {c} more books. How many books does it have now?",
     lambda a, b, c: a * b + c),
    ("A farmer packs {a} eggs a day for {b} days, then {c} of them break. How many eggs are left?",
     lambda a, b, c: a * b - c),
    ("A school orders {a} boxes of {b} pencils and {c} loose pencils. How many pencils is that?",
     lambda a, b, c: a * b + c),
    ("Tickets cost {b} dollars. A club buys {a} tickets and pays with {c} dollars more than the price. How "
     "many dollars does it pay?", lambda a, b, c: a * b + c),
)


def make_word_problems(
    n: int,
    seed: int = 0,
    *,
    taskset: str = "word_problems",
    repeat_times: int | None = None,
) -> list[Task]:
    """``n`` arithmetic word problems (a product of two 2-digit numbers plus or minus a third) for the
    ``calculator`` tool environment: payload ``{"question", "answer"}``, ids ``<taskset>-<seed>-<i>``. The
    same seed gives the same tasks."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        template, answer = _WORD_PROBLEMS[rng.randrange(len(_WORD_PROBLEMS))]
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        c = rng.randint(1, a * b - 1)
        tasks.append(
            Task(
                task_id=f"{taskset}-{seed}-{i}",
                workflow="calculator",
                payload=json.dumps({"question": template.format(a=a, b=b, c=c), "answer": answer(a, b, c)}),
                taskset=taskset,
                repeat_times=repeat_times,
            )
        )
    return tasks


# (question template, answer) pairs whose answers are fractions: numbers a, b, c are drawn per task.
_FRACTION_PROBLEMS = (
    ("A pizza is cut into {c} equal slices. Ann eats {a} of them and Ben eats {b}. What fraction of the pizza is "
     "left?", lambda a, b, c: Fraction(c - a - b, c)),
    ("A rope {c} metres long is cut into {a} equal pieces. How many metres long is each piece?",
     lambda a, b, c: Fraction(c, a)),
    ("A tank holds {c} litres. {a} litres are poured out, then {b} litres more. What fraction of the tank was "
     "poured out?", lambda a, b, c: Fraction(a + b, c)),
)


def latex_number(value: Fraction) -> str:
    r"""``5`` or ``\frac{5}{8}`` (``-\frac{1}{2}`` when negative)."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def make_fraction_word_problems(
    n: int,
    seed: int = 0,
    *,
    taskset: str = "fraction_word_problems",
    repeat_times: int | None = None,
) -> list[Task]:
    r"""``n`` word problems whose answers are fractions, written in LaTeX (``\frac{5}{8}``), for the
    ``math_boxed`` workflow with ``reward_fn: math_verify``, which also accepts ``5/8`` or ``0.625``. Payload
    ``{"question", "answer"}``, ids ``<taskset>-<seed>-<i>``; the same seed gives the same tasks."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        template, answer = _FRACTION_PROBLEMS[rng.randrange(len(_FRACTION_PROBLEMS))]
        c = rng.randint(6, 24)
        a, b = rng.randint(1, c // 2 - 1), rng.randint(1, c // 2 - 1)
        tasks.append(
            Task(
                task_id=f"{taskset}-{seed}-{i}",
                workflow="math_boxed",
                payload=json.dumps({"question": template.format(a=a, b=b, c=c),
                                    "answer": latex_number(answer(a, b, c))}),
                taskset=taskset,
                reward_fn="math_verify",
                repeat_times=repeat_times,
            )
        )
    return tasks
