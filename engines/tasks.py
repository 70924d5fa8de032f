"""Task sets built in code (no Kafka): the arithmetic demo taskset."""
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
