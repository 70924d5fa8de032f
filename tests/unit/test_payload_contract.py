"""The payload contract (schemas/payloads/): a JSON Schema for each built-in workflow and reward, in step with the
code that reads the payload (what a schema accepts runs, what the workflow cannot use is refused by the schema),
and applied where tasks are read (``check_task``: the DLQ reason names the key)."""
from __future__ import annotations

import json

import pytest

from streamrft.engines.inference import create_engine
from streamrft.engines.workflows import WorkflowError, run_workflow
from streamrft.engines.workflows.build import get_workflow_class
from streamrft.engines.workflows.registry import _ENVIRONMENTS, _REWARDS, _WORKFLOWS, get_environment_class
from streamrft.schemas import InvalidRecordError, RolloutKind, RolloutRequest, Task
from streamrft.schemas.payload_contract import (DEFAULT_REWARD, PayloadError, _validator, check_payload,
                                                payload_schemas, published_rewards, published_workflows,
                                                workflow_schema_path)
from streamrft.validation import check_request, check_task



def _built_in(registry: dict) -> list[str]:
    """The names the project's own modules registered (test modules register their own workflows, which have no
    published schema, as a plugin's would not)."""
    return sorted(name for name, item in registry.items()
                  if getattr(item, "__module__", "").startswith("streamrft.engines."))


BUILT_IN_WORKFLOWS = _built_in({**_WORKFLOWS, **_ENVIRONMENTS})

# (workflow, reward_fn, payload) the schemas accept; each one runs through its workflow
ACCEPTED = [
    ("arithmetic", None, {"question": "What is 3 + 4?", "answer": 7}),
    ("arithmetic", None, {"question": "What is 3 + 4?", "answer": "7", "system": "Be brief.", "format_weight": 0.5}),
    ("arithmetic", None, {"a": 3, "b": 4}),
    ("arithmetic", "format", {"question": "q"}),
    ("math_boxed", None, {"question": "Half of 1?", "answer": "\\frac{1}{2}", "instruction": "Box it."}),
    ("math_boxed", "math_verify", {"question": "Half of 1?", "answer": 0.5}),
    ("guess_number", None, {"target": 37, "low": 1, "high": 50, "max_turns": 3}),
    ("calculator", None, {"question": "What is 12 * 34?", "answer": 408, "rubric": "kept for a judge"}),
]
# (workflow, reward_fn, payload, the key the reason names)
REFUSED = [
    ("arithmetic", None, {}, "question"),
    ("arithmetic", None, {"question": "q"}, "answer"),  # exact_number needs the reference
    ("arithmetic", None, {"question": 3, "answer": 7}, "question"),
    ("arithmetic", None, {"question": "q", "answer": True}, "answer"),
    ("arithmetic", None, {"a": "3", "b": 4}, "a"),
    ("math_boxed", None, {"answer": "1"}, "question"),
    ("math_boxed", None, {"question": "q", "answer": "1", "format_weight": -1}, "format_weight"),
    ("guess_number", None, {"low": 1}, "target"),
    ("guess_number", None, {"target": 5, "max_turns": 0}, "max_turns"),
    ("calculator", None, {"question": "q"}, "answer"),
    ("arithmetic", "judge", {"question": "q", "judge_model": ""}, "judge_model"),
]


def test_every_built_in_workflow_and_reward_has_a_schema_and_every_schema_a_workflow_or_reward():
    assert published_workflows() == BUILT_IN_WORKFLOWS
    assert published_rewards() == _built_in(_REWARDS)
    for name in published_workflows():
        assert _validator(workflow_schema_path(name)) is not None  # a valid draft 2020-12 schema


@pytest.mark.parametrize("workflow", BUILT_IN_WORKFLOWS)
def test_the_default_reward_a_schema_names_is_the_workflows(workflow):
    """What scores a task that names no reward: the workflow's default_reward, or a tool environment's
    answer_reward (its outcome)."""
    declared = json.loads(workflow_schema_path(workflow).read_text()).get(DEFAULT_REWARD)
    if workflow in _ENVIRONMENTS:
        assert declared == getattr(get_environment_class(workflow), "answer_reward", None)
    else:
        assert declared == get_workflow_class(workflow).default_reward


def _run(workflow: str, reward_fn: str | None, payload: dict):
    task = Task(task_id="t", workflow=workflow, payload=json.dumps(payload), reward_fn=reward_fn)
    return run_workflow(task, create_engine("fake", responder=lambda prompt, j: "50"), 2)


@pytest.mark.parametrize("workflow, reward_fn, payload", ACCEPTED)
def test_what_a_schema_accepts_its_workflow_runs(workflow, reward_fn, payload):
    check_payload(workflow, reward_fn, payload)
    samples = _run(workflow, reward_fn, payload)
    assert len(samples) == 2 and all(s.failure is None for s in samples)


@pytest.mark.parametrize("workflow, reward_fn, payload, key", REFUSED)
def test_what_a_schema_refuses_names_the_key(workflow, reward_fn, payload, key):
    with pytest.raises(PayloadError) as refused:
        check_payload(workflow, reward_fn, payload)
    assert refused.value.field == key and repr(key) in str(refused.value)
    assert "schemas/payloads/" in str(refused.value)


@pytest.mark.parametrize("workflow, payload", [("arithmetic", {}), ("arithmetic", {"question": "q"}),
                                               ("math_boxed", {"answer": "1"}), ("guess_number", {"low": 1})])
def test_a_missing_key_the_schema_requires_fails_the_workflow_too(workflow, payload):
    """The schemas require no more than the code reads: without the key, the workflow fails the task."""
    with pytest.raises(WorkflowError):
        _run(workflow, None, payload)


def test_check_task_dead_letters_a_bad_payload_with_the_key_and_check_request_leaves_it_to_the_worker():
    task = Task(task_id="t1", workflow="guess_number", payload=json.dumps({"target": "seven"}))
    with pytest.raises(InvalidRecordError) as refused:
        check_task(task)
    assert refused.value.reason == "bad-payload"
    assert "task 't1': payload field 'target' is invalid" in str(refused.value) and "integer" in str(refused.value)
    # the explorer's request of a file taskset's task: the worker FAILS it with a result, no dead letter
    check_request(RolloutRequest(request_id="r", step=0, kind=RolloutKind.TRAIN, task=task, repeat_times=1))


def test_a_workflow_without_a_schema_is_not_checked_here():
    check_task(Task(task_id="t", workflow="my_plugin", payload=json.dumps({"anything": 1})))
    check_task(Task(task_id="t", workflow="../arithmetic", payload="{}"))  # a name, never a path


def test_payload_schemas_lists_every_published_schema():
    published = payload_schemas()
    assert sorted(published["workflows"]) == published_workflows()
    assert sorted(published["rewards"]) == published_rewards()


def test_the_schemas_command_prints_the_payload_schemas(capsys):
    from streamrft.cli import main

    assert main(["schemas", "--payloads"]) == 0
    assert json.loads(capsys.readouterr().out) == payload_schemas()
