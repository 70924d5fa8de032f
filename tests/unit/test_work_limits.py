"""Caps on the work a task may ask for, and isolation of co-batched tasks: a failing prompt fails only its own
task. Fake engine, no broker."""
from __future__ import annotations

import json

from streamrft.engines.inference import create_engine
from streamrft.engines.inference.base import SamplingParams
from streamrft.engines.workflows.base import WorkflowError
from streamrft.engines.workflows.scheduler import run_workflows
from streamrft.engines.settings.limits import WorkLimits
from streamrft.schemas import Task


def arithmetic(task_id: str, question: str = "1 + 1") -> Task:
    return Task(task_id=task_id, workflow="arithmetic", payload=json.dumps({"question": question, "answer": "2"}))


def test_over_the_caps_a_task_fails_alone_with_the_reason():
    engine = create_engine("fake", latency_s=0)
    tasks = [arithmetic("ok"), arithmetic("many"), arithmetic("long", "1 + 1 " * 400),
             Task(task_id="turns", workflow="guess_number", payload=json.dumps({"target": 3, "max_turns": 50}))]
    limits = WorkLimits(max_repeat_times=8, max_turns=10, max_prompt_tokens=200)
    out = run_workflows(tasks, engine, [2, 100, 2, 2], SamplingParams(max_tokens=4), limits)
    assert len(out[0]) == 2 and not isinstance(out[0], WorkflowError)
    assert "limits.max_repeat_times" in str(out[1])
    assert "limits.max_prompt_tokens" in str(out[2])
    assert "limits.max_turns" in str(out[3])


def test_a_prompt_that_breaks_the_engine_fails_only_its_own_task():
    engine = create_engine("fake", latency_s=0)
    real_generate = engine.generate

    def generate(prompts, params, n=1):
        if any("poison" in str(p) for p in prompts):
            raise RuntimeError("the engine cannot take this prompt")
        return real_generate(prompts, params, n)

    engine.generate = generate
    tasks = [arithmetic("a"), arithmetic("b", "poison"), arithmetic("c")]
    out = run_workflows(tasks, engine, 2, SamplingParams(max_tokens=4))
    assert isinstance(out[1], WorkflowError) and "cannot take this prompt" in str(out[1])
    assert all(len(samples) == 2 for samples in (out[0], out[2]))
