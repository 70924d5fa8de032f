"""Workflows and rewards: parsing edge cases, multi-turn action masks, failures surfacing as WorkflowError."""
from __future__ import annotations

import json
import re
from fractions import Fraction
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.tasks import make_arithmetic_tasks
from streamrft.engines.workflows import (
    Reward,
    Workflow,
    WorkflowError,
    WorkflowSample,
    answers_match,
    final_number,
    get_reward,
    last_boxed,
    register_reward,
    register_workflow,
    registry,
    run_workflow,
    unregister_reward,
    unregister_workflow,
)
from streamrft.schemas import RolloutKind, Task, unpack_f32, unpack_i32, unpack_u8


def task(workflow: str, payload: dict | str, **kwargs) -> Task:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return Task(task_id="t1", workflow=workflow, payload=text, **kwargs)


def scripted(*responses: str):
    """A fake engine answering sample j with responses[j]."""
    return create_engine("fake", responder=lambda prompt, j: responses[j])


# -- parsing and rewards -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 7.", 7),
        ("3 + 4 = 7", 7),
        ("12 apples and 5 pears", 5),
        ("-3", -3),
        ("it is -12!", -12),
        ("10-3 is 7", 7),
        ("from 1-10", 10),  # a hyphen after a digit is not a sign
        ("1,000", 1000),
        ("3, 4", 4),
        ("7.0", 7),
        ("2.50 dollars", Fraction(5, 2)),
        ("3/4", Fraction(3, 4)),
        ("1/0 then 5", 5),
        ("v2", None),
        ("", None),
        ("no number here", None),
    ],
)
def test_final_number(text: str, expected) -> None:
    assert final_number(text) == (None if expected is None else Fraction(expected))


@pytest.mark.parametrize(
    "response, answer, correct",
    [
        ("7", 7, True),
        ("So 3 + 4 = 7.", "7", True),
        ("7.0", 7, True),
        ("7 is wrong, it is 8", 7, False),
        ("seven", 7, False),
        ("", 7, False),
        ("1,024", 1024, True),
    ],
)
def test_exact_number(response: str, answer, correct: bool) -> None:
    reward = get_reward("exact_number")(response, {"answer": answer})
    assert reward.correct is correct and reward.value == float(correct)


def test_exact_number_needs_a_numeric_answer() -> None:
    with pytest.raises(KeyError):
        get_reward("exact_number")("7", {})
    with pytest.raises(ValueError):
        get_reward("exact_number")("7", {"answer": "seven"})


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so \boxed{7}", "7"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{x^{2}+1} done", "x^{2}+1"),
        (r"\boxed{3} and \boxed{4", "3"),  # last one unbalanced: fall back to the earlier one
        ("no box", None),
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed(text: str, boxed) -> None:
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "given, reference, match",
    [
        ("7", 7, True),
        (r"\frac{1}{2}", "1/2", True),
        (r"\dfrac{1}{2}", "0.5", True),
        ("$7$", "7", True),
        (r"\text{7}", "7", True),
        ("x + 1", "x+1", True),
        ("8", 7, False),
        ("x+2", "x+1", False),
    ],
)
def test_answers_match(given: str, reference, match: bool) -> None:
    assert answers_match(given, reference) is match


def test_boxed_and_format_rewards() -> None:
    boxed = get_reward("boxed_match")
    assert boxed(r"The sum is \boxed{\frac{3}{4}}.", {"answer": "3/4"}).correct
    assert not boxed("The sum is 3/4", {"answer": "3/4"}).correct
    assert boxed("x", {"answer": 1}).metrics["reward/has_boxed"] == 0.0
    fmt = get_reward("format")
    assert [fmt(t, {}).value for t in ("3 + 4 = 7", "It is 7.", "7 because", "")] == [1.0, 1.0, 0.0, 0.0]
    assert not fmt("7", {}).correct  # shaping only
    assert get_reward("format_boxed")(r"\boxed{1}", {}).value == 1.0
    assert get_reward("format_boxed")(r"\boxed{1} \boxed{2}", {}).value == 0.0


def test_reward_of_accepts_numbers() -> None:
    assert Reward.of(1) == Reward(1.0, correct=True)
    assert Reward.of(0.0) == Reward(0.0, correct=False)
    with pytest.raises(TypeError):
        Reward.of("1")


# -- single-turn workflows ---------------------------------------------------------------------------------------


def test_arithmetic_workflow_scores_each_sample() -> None:
    engine = scripted("3 + 4 = 7", "It is 8.", "7 is the answer", "nothing")
    samples = run_workflow(task("arithmetic", {"question": "What is 3 + 4?", "answer": 7}), engine, 4)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert [s.correct for s in samples] == [True, False, True, False]
    for s in samples:
        assert s.prompt_text == "What is 3 + 4?"
        assert s.action_mask is None and not s.truncated
        assert len(s.logprobs) == s.response_length
        assert s.info["finish_reason"] == "stop"
    assert samples[0].response_text == "3 + 4 = 7"


def test_arithmetic_format_weight_and_ab_payload() -> None:
    engine = scripted("7 is the answer", "so 7")
    samples = run_workflow(task("arithmetic", {"a": 3, "b": 4, "format_weight": 0.25}), engine, 2)
    assert [s.reward for s in samples] == [1.0, 1.25]
    assert samples[1].metrics["reward/format"] == 1.0 and samples[0].metrics["reward/format"] == 0.0
    assert samples[0].prompt_text == "What is 3 + 4?"


def test_task_reward_fn_overrides_the_default() -> None:
    engine = scripted("no digits")
    samples = run_workflow(task("arithmetic", {"question": "q", "answer": 1}, reward_fn="format"), engine, 1)
    assert samples[0].reward == 0.0
    engine = scripted("wrong: 2")
    samples = run_workflow(task("arithmetic", {"question": "q", "answer": 1}, reward_fn="format"), engine, 1)
    assert samples[0].reward == 1.0


def test_math_boxed_asks_for_a_box() -> None:
    seen = []

    def respond(prompt: str, j: int) -> str:
        seen.append(prompt)
        return r"\boxed{\frac{1}{2}}"

    engine = create_engine("fake", responder=respond)
    (sample,) = run_workflow(task("math_boxed", {"question": "Half of 1?", "answer": "0.5"}), engine, 1)
    assert sample.correct and sample.reward == 1.0
    assert "\\boxed{}" in seen[0]


def test_truncated_sample() -> None:
    engine = scripted("1234567890")
    (s,) = run_workflow(task("arithmetic", {"question": "q", "answer": 1}), engine, 1, SamplingParams(max_tokens=4))
    assert s.truncated and s.response_length == 4 and s.info["finish_reason"] == "length"


def test_repeat_times_defaults_to_the_task() -> None:
    engine = create_engine("fake")
    samples = run_workflow(task("arithmetic", {"question": "q", "answer": 1}, repeat_times=3), engine)
    assert len(samples) == 3


def test_to_experience_packs_everything() -> None:
    sample = WorkflowSample(
        tokens=[1, 2, 3, 4, 5],
        prompt_length=2,
        logprobs=[-0.5, -1.0, 0.0],
        reward=0.5,
        action_mask=[1, 1, 0],
        metrics={"turns": 2},
        info={"found": "true"},
        model_version=4,
    )
    exp = sample.to_experience(
        eid="e", group_id="g", task_id="t", step=3, kind=RolloutKind.TRAIN, run_index=1, worker_id="w"
    )
    assert unpack_i32(exp.tokens).tolist() == [1, 2, 3, 4, 5]
    assert unpack_f32(exp.logprobs).tolist() == [-0.5, -1.0, 0.0]
    assert unpack_u8(exp.action_mask).tolist() == [1, 1, 0]
    assert exp.response_length == 3 and exp.model_version == 4 and exp.metrics == {"turns": 2.0}


def test_make_arithmetic_tasks() -> None:
    tasks = make_arithmetic_tasks(50, seed=3, low=1, high=20)
    again = make_arithmetic_tasks(50, seed=3, low=1, high=20)
    assert [(t.task_id, t.payload) for t in tasks] == [(t.task_id, t.payload) for t in again]
    assert len({t.task_id for t in tasks}) == 50
    for t in tasks:
        payload = json.loads(t.payload)
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", payload["question"]).groups())
        assert 1 <= a <= 20 and 1 <= b <= 20 and payload["answer"] == a + b
        assert t.workflow == "arithmetic"
    assert [t.payload for t in tasks] != [t.payload for t in make_arithmetic_tasks(50, seed=4)]


# -- multi-turn --------------------------------------------------------------------------------------------------


def guesser(*guesses: str):
    """Episode j answers guesses in order, one per model turn (turn = assistant turns so far)."""
    return create_engine("fake", responder=lambda prompt, j: guesses[prompt.count("<|im_start|>assistant") - 1])


def test_guess_number_action_mask_covers_only_model_turns() -> None:
    engine = guesser("50", "25", "37")
    payload = {"target": 37, "max_turns": 5}
    (s,) = run_workflow(task("guess_number", payload), engine, 1)
    assert s.reward == 1.0 and s.correct and s.metrics["turns"] == 3.0

    response = s.tokens[s.prompt_length :]
    trained = engine.decode([t for t, m in zip(response, s.action_mask) if m], skip_special_tokens=False)
    inserted = engine.decode([t for t, m in zip(response, s.action_mask) if not m], skip_special_tokens=False)
    assert trained == "50<|im_end|>25<|im_end|>37<|im_end|>"
    assert inserted == "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n" + (
        "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.action_mask) if not m)
    assert all(lp == -1.0 for lp, m in zip(s.logprobs, s.action_mask) if m)
    assert s.action_mask[-1] == 1  # the episode ends on the model's turn

    # the token sequence is exactly the chat template's rendering of the conversation
    conversation = [
        {"role": "user", "content": s.prompt_text},
        {"role": "assistant", "content": "50"},
        {"role": "user", "content": "Lower."},
        {"role": "assistant", "content": "25"},
        {"role": "user", "content": "Higher."},
        {"role": "assistant", "content": "37"},
    ]
    rendered = engine.render_chat(conversation, add_generation_prompt=False)
    assert s.tokens == engine.encode(rendered.removesuffix("\n"))


def test_guess_number_gives_up_after_max_turns_and_counts_invalid() -> None:
    engine = guesser("90", "lots", "80")
    (s,) = run_workflow(task("guess_number", {"target": 5, "max_turns": 3}), engine, 1)
    assert s.reward == 0.0 and not s.correct
    # the model's tokens: "90", "lots", "80", each with its <|im_end|>
    assert s.metrics == {"turns": 3.0, "turns_cut": 0.0, "invalid_guesses": 1.0, "model_tokens": 11.0,
                         "response_length": float(s.response_length)}
    assert s.info.pop("turn_states").count(":") == 3  # one state per model turn (test_gigpo.py)
    assert not s.truncated and s.info == {"finish": "done", "found": "false"}  # the game's own end, not a cut
    assert "user: Please reply with a whole number." in s.response_text
    assert s.response_text.count("user: Lower.") == 1 and s.action_mask[-1] == 1


def test_guess_number_turn_cut_at_max_tokens_is_closed_by_the_environment() -> None:
    engine = guesser("123456", "5")
    (s,) = run_workflow(task("guess_number", {"target": 5}), engine, 1, SamplingParams(max_tokens=3))
    assert s.correct and s.metrics["turns_cut"] == 1.0
    assert not s.truncated  # the episode itself ended by the game's rule: its reward is a real outcome
    response = engine.decode(s.tokens[s.prompt_length :], skip_special_tokens=False)
    assert response.startswith("123<|im_end|>\n<|im_start|>user\n")  # closed by the env (mask 0)
    assert s.action_mask[:4] == [1, 1, 1, 0]


def test_guess_number_episodes_are_batched_per_turn() -> None:
    engine = guesser("50", "25", "12")
    samples = run_workflow(task("guess_number", {"target": 12, "max_turns": 4}), engine, 3)
    assert len(samples) == 3 and all(s.correct for s in samples)
    assert engine.calls == 3  # one engine call per turn, not per episode


@pytest.mark.model
def test_guess_number_on_the_tiny_model(tiny_model_dir: Path) -> None:
    engine = create_engine("transformers", tiny_model_dir)
    params = SamplingParams(max_tokens=6, seed=0)
    samples = run_workflow(task("guess_number", {"target": 3, "max_turns": 3}), engine, 2, params)
    again = run_workflow(task("guess_number", {"target": 3, "max_turns": 3}), engine, 2, params)
    assert [s.tokens for s in samples] == [s.tokens for s in again]
    assert samples[0].tokens != samples[1].tokens  # episodes are seeded apart
    for s in samples:
        assert len(s.action_mask) == len(s.logprobs) == s.response_length
        assert sum(s.action_mask) <= 3 * 6 and s.action_mask[-1] == 1


# -- failures ----------------------------------------------------------------------------------------------------


@pytest.fixture
def plugin_names():
    yield
    unregister_workflow("test_boom")
    unregister_workflow("test_short")
    unregister_reward("test_boom")


def test_raising_workflow_surfaces_as_workflow_error(plugin_names) -> None:
    @register_workflow("test_boom")
    class Boom(Workflow):
        def run(self, task, payload, engine, repeat_times, sampling):
            raise RuntimeError("environment exploded")

    with pytest.raises(WorkflowError, match="environment exploded") as info:
        run_workflow(task("test_boom", {}), create_engine("fake"), 2)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "RuntimeError" in info.value.cause_traceback
    assert info.value.task_id == "t1" and info.value.workflow == "test_boom"


def test_raising_reward_surfaces_as_workflow_error(plugin_names) -> None:
    @register_reward("test_boom")
    def boom(response, payload):
        raise ZeroDivisionError("bad reward")

    with pytest.raises(WorkflowError, match="bad reward"):
        run_workflow(task("arithmetic", {"question": "q", "answer": 1}, reward_fn="test_boom"), create_engine("fake"))


def test_inconsistent_samples_surface_as_workflow_error(plugin_names) -> None:
    @register_workflow("test_short")
    class Short(Workflow):
        def run(self, task, payload, engine, repeat_times, sampling):
            return [WorkflowSample(tokens=[1, 2, 3], prompt_length=1, logprobs=[0.0], reward=0.0)] * repeat_times

    with pytest.raises(WorkflowError, match="1 logprobs for 2 response tokens"):
        run_workflow(task("test_short", {}), create_engine("fake"), 1)


@pytest.mark.parametrize(
    "bad_task, message",
    [
        (task("no_such_workflow", {}), "unknown workflow"),
        (task("arithmetic", {"question": "q", "answer": 1}, reward_fn="no_such_reward"), "unknown reward"),
        (task("arithmetic", "{not json"), "not JSON"),
        (task("arithmetic", "[1, 2]"), "JSON object"),
        (task("arithmetic", {"answer": 1}), "question"),
        (task("guess_number", {}), "target"),
    ],
)
def test_bad_tasks_surface_as_workflow_error(bad_task: Task, message: str) -> None:
    with pytest.raises(WorkflowError, match=message):
        run_workflow(bad_task, create_engine("fake"), 1)


def test_plugins_are_found_by_entry_point(monkeypatch: pytest.MonkeyPatch, plugin_names) -> None:
    plugins = [
        EntryPoint("test_boom", "streamrft.engines.workflows.arithmetic:ArithmeticWorkflow", registry.WORKFLOW_GROUP),
        EntryPoint("test_boom", "streamrft.engines.workflows.rewards:format_number", registry.REWARD_GROUP),
    ]

    def fake_entry_points(group: str, name: str | None = None):
        return [ep for ep in plugins if ep.group == group and (name is None or ep.name == name)]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    assert "test_boom" in registry.workflow_names() and "test_boom" in registry.reward_names()
    engine = scripted("The answer is 2")
    (s,) = run_workflow(task("test_boom", {"question": "q", "answer": 1}, reward_fn="test_boom"), engine, 1)
    assert s.reward == 1.0 and not s.correct  # the format reward, via the plugin name


# -- several tasks at once ---------------------------------------------------------------------------------------


@pytest.mark.model
def test_run_workflows_batches_and_matches_sequential(tiny_model_dir: Path) -> None:
    from streamrft.engines.workflows import WorkflowPool, run_workflows

    engine = create_engine("transformers", tiny_model_dir)
    tasks = make_arithmetic_tasks(3, seed=1) + [task("guess_number", {"target": 3, "max_turns": 2})]
    params = SamplingParams(max_tokens=6, seed=4)
    sequential = [run_workflow(t, engine, 2, params) for t in tasks]
    together = run_workflows(tasks, engine, 2, params)
    assert [[s.tokens for s in r] for r in together] == [[s.tokens for s in r] for r in sequential]
    for got, want in zip(together, sequential):
        for a, b in zip(got, want):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert a.action_mask == b.action_mask and a.reward == b.reward

    pool = WorkflowPool(engine)
    for i, one in enumerate(tasks):
        pool.start(i, one, 2, params)
    while pool.running:
        pool.drive(timeout=1.0)
    assert pool.shared.calls_per_step == [4, 1]  # turn 1: all four tasks in one call; turn 2: only the multi-turn one


def test_run_workflows_isolates_failures(plugin_names) -> None:
    from streamrft.engines.workflows import run_workflows

    @register_workflow("test_boom")
    class Boom(Workflow):
        def run(self, task, payload, engine, repeat_times, sampling):
            raise RuntimeError("only this one")

    tasks = [
        task("arithmetic", {"question": "q", "answer": 7}),
        task("test_boom", {}),
        task("guess_number", {"target": 7, "max_turns": 3}),
    ]
    results = run_workflows(tasks, guesser("9", "7", "7"), [2, 1, 1])
    assert isinstance(results[1], WorkflowError) and "only this one" in str(results[1])
    assert len(results[0]) == 2 and results[2][0].correct
    assert run_workflows([], create_engine("fake")) == []


def test_exact_number_refuses_a_task_without_an_answer_whatever_the_response():
    from streamrft.engines.workflows.rewards import exact_number

    for response in ("no digits at all", "1 + 1 = 2"):
        with pytest.raises(KeyError, match="no 'answer'"):
            exact_number(response, {"question": "What is 1 + 1?"})


def test_a_pool_on_an_incremental_engine_hands_back_each_workflow_when_it_is_done() -> None:
    from streamrft.engines.workflows import WorkflowPool

    engine = create_engine("fake", latency_s=0.05, incremental=True)
    pool = WorkflowPool(engine)
    pool.start("slow", task("arithmetic", {"question": "q", "answer": 7}), 20, SamplingParams())  # 1 s
    order = []
    for _ in range(3):
        pool.drive(timeout=0.1)
    pool.start("fast", task("arithmetic", {"question": "q", "answer": 7}), 1, SamplingParams())  # 0.05 s
    while pool.running:
        order += [key for key, outcome in pool.drive(timeout=0.5) if len(outcome) > 0]
    assert order == ["fast", "slow"]  # started later, joined the running batch, came back first


def test_a_cancelled_workflow_stops_and_is_not_handed_back() -> None:
    from streamrft.engines.workflows import WorkflowPool

    engine = create_engine("fake", latency_s=1.0, incremental=True)
    pool = WorkflowPool(engine)
    pool.start("dropped", task("arithmetic", {"question": "q", "answer": 7}), 30, SamplingParams())
    pool.start("kept", task("arithmetic", {"question": "q", "answer": 7}), 1, SamplingParams())
    pool.drive(timeout=0.1)
    pool.cancel({"dropped"})
    handed = []
    while pool.running:
        handed += [key for key, _ in pool.drive(timeout=0.5)]
    assert handed == ["kept"] and engine.unfinished == 0
