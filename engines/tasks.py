"""Task sets built in code (no Kafka): the arithmetic demo taskset and word problems for the calculator tool."""
from __future__ import annotations

import json
import random

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
