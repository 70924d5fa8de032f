"""Multi-turn episodes (engines/workflows/episode.py) and tool use (tools.py, calculator.py): masks, per-turn
rewards, the run's turn and token budget, environment plugins; mask_truncated (grpo_reward_to_go's hand-computed
test is in test_algorithms.py with the other registry entries)."""
from __future__ import annotations

import json
from fractions import Fraction
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.tasks import make_word_problems
from streamrft.engines.workflows import (
    Environment,
    Turn,
    WorkflowError,
    register_environment,
    registry,
    run_workflow,
    unregister_environment,
)
from streamrft.engines.workflows.calculator import Calculator, evaluate
from streamrft.engines.settings.limits import WorkLimits
from streamrft.engines.workflows.rewards import Reward
from streamrft.engines.workflows.tools import ToolError
from streamrft.schemas import Task, unpack_f32

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
LONG = SamplingParams(max_tokens=128)  # a call is ~90 tokens of the test tokenizer
QUESTION = {"question": "A baker fills 23 trays with 47 muffins each and sells 81. How many are left?",
            "answer": 1000}


def task(workflow: str, payload: dict, **kwargs) -> Task:
    return Task(task_id="t1", workflow=workflow, payload=json.dumps(payload), **kwargs)


def turns(*replies: str):
    """A fake engine whose every episode says replies[t] at its model turn t."""
    return create_engine("fake", responder=lambda prompt, j: replies[prompt.count("<|im_start|>assistant") - 1])


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s: the model's turns."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


# -- the calculator tool -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("23 * 47 - 81", 1000), ("(3 + 4) / 2", Fraction(7, 2)), ("2 ** 10", 1024), ("2^3", 8), ("-5 + 2", -3),
    ("10 // 3", 3), ("10 % 4", 2), ("1.5 * 4", 6), ("12 × 3 ÷ 4", 9),
])
def test_calculator_evaluates_arithmetic_exactly(expression: str, value) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ('__import__("os").system("true")', "only numbers"), ("x + 1", "only numbers"), ("abs(-1)", "only numbers"),
    ("(1).real", "only numbers"), ("1 / 0", "division by zero"), ("2 ** 0.5", "exponents"),
    ("10 ** 65", "exponents"), ("(10 ** 40) ** 2", "digits"), ("1 +", "cannot parse"), ("", "empty"),
    ("1+" * 150 + "1", "longer than"), ("True + 1", "only numbers"),
    ("1e999", "finite"), ("1e999 - 1e999", "finite"), ("9" * 100, "digits"), ("1e308 * 10", "digits"),
])
def test_calculator_refuses_anything_else(expression: str, reason: str) -> None:
    with pytest.raises(ToolError, match=reason):
        evaluate(expression)


@pytest.mark.parametrize("expression, shown", [
    ("1 / 3", "0.333333"), ("-1 / 3", "-0.333333"), ("10 ** 50 / 3", "3" * 50 + ".333333"), ("-1e-7", "0"),
    ("100 / 8", "12.5"), ("5 / 2 * 2", "5"),
])
def test_calculator_shows_decimals_exactly(expression: str, shown: str) -> None:
    from streamrft.engines.workflows.calculator import calculate

    assert calculate(expression) == shown


def test_any_arithmetic_failure_of_a_tool_is_a_bad_call_not_a_failed_episode() -> None:
    from streamrft.engines.workflows.tools import Tool, ToolEnvironment

    def overflowing(x: str) -> str:
        return str(float(10) ** int(x))  # OverflowError for a large x

    tool = Tool(name="power", description="10 to the x", parameters={"type": "object"}, function=overflowing)
    with pytest.raises(ToolError, match="OverflowError"):
        ToolEnvironment.run_tool(tool, {"x": "400"})
    with pytest.raises(ToolError, match="ValueError"):
        ToolEnvironment.run_tool(tool, {"x": "ten"})


def test_word_problems_are_seeded_and_their_answers_right() -> None:
    tasks = make_word_problems(20, seed=3)
    assert [t.payload for t in tasks] == [t.payload for t in make_word_problems(20, seed=3)]
    assert len({t.task_id for t in tasks}) == 20 and all(t.workflow == "calculator" for t in tasks)
    for t in tasks:
        payload = json.loads(t.payload)
        a, b, c = (int(n) for n in __import__("re").findall(r"\d+", payload["question"]))
        assert payload["answer"] in (a * b - c, a * b + c) and payload["answer"] >= 0


# -- episodes ----------------------------------------------------------------------------------------------------


def test_a_calculator_episode_trains_only_the_model_turns() -> None:
    engine = turns(CALL.format("23 * 47 - 81"), "There are 1000 muffins left.")
    (s,) = run_workflow(task("calculator", QUESTION), engine, 1, LONG)
    assert s.reward == 1.0 and s.correct and not s.truncated
    assert s.metrics["turns"] == 2 and s.metrics["tool_calls"] == 1 and s.metrics["bad_tool_calls"] == 0
    assert s.token_rewards is None  # no per-turn reward was given
    response = s.tokens[s.prompt_length:]
    model = [engine.decode(response[a:b], skip_special_tokens=False) for a, b in spans(s.action_mask)]
    assert model == [CALL.format("23 * 47 - 81") + "<|im_end|>", "There are 1000 muffins left.<|im_end|>"]
    inserted = engine.decode([t for t, m in zip(response, s.action_mask) if not m], skip_special_tokens=False)
    assert inserted == "\n<|im_start|>tool\n1000<|im_end|>\n<|im_start|>assistant\n"  # the tool's result
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.action_mask) if not m)
    # the tokens are the chat template's rendering of the whole conversation, the tool listed in the system turn
    opening = Calculator(QUESTION).opening()
    assert '"name": "calculator"' in opening[0]["content"]
    conversation = [*opening, {"role": "assistant", "content": CALL.format("23 * 47 - 81")},
                    {"role": "tool", "content": "1000"},
                    {"role": "assistant", "content": "There are 1000 muffins left."}]
    rendered = engine.render_chat(conversation, add_generation_prompt=False)
    assert s.tokens == engine.encode(rendered.removesuffix("\n"))


def test_a_bad_tool_call_gets_an_error_and_a_per_turn_reward_on_its_last_token() -> None:
    engine = turns('<tool_call>{"name": "calculator", "arguments": {"expression": "23 * x"}}</tool_call>',
                   '<tool_call>{"name": "search", "arguments": {}}</tool_call>', "1000")
    (s,) = run_workflow(task("calculator", QUESTION), engine, 1, LONG)
    assert s.correct and s.metrics["bad_tool_calls"] == 2 and s.metrics["turns"] == 3
    assert "tool: Error: only numbers" in s.response_text and "no tool named 'search'" in s.response_text
    rewarded = [i for i, r in enumerate(s.token_rewards) if r != 0]
    assert [s.token_rewards[i] for i in rewarded] == pytest.approx([-0.1, -0.1])
    assert rewarded == [b - 1 for a, b in spans(s.action_mask)[:2]]  # the last token of turns 1 and 2
    exp = s.to_experience(eid="e", group_id="g", task_id="t1", step=0, kind=0, run_index=0)
    assert unpack_f32(exp.token_rewards).tolist() == pytest.approx(s.token_rewards)


def test_the_turn_budget_cuts_an_episode_and_marks_it_truncated() -> None:
    engine = turns(*[CALL.format("1 + 1")] * 10)
    (s,) = run_workflow(task("calculator", QUESTION), engine, 1, LONG, limits=WorkLimits(max_turns=3))
    assert s.truncated and s.info["finish"] == "max_turns" and s.reward == 0.0
    assert s.metrics["turns"] == 3 and s.metrics["answered"] == 0.0
    assert s.action_mask[-1] == 1  # it ends on the model's turn: the tool's last reply is not added


def test_the_token_budget_bounds_every_model_turn_and_cuts_the_episode() -> None:
    engine = turns(*[CALL.format("1 + 1")] * 10)
    limits = WorkLimits(max_episode_tokens=250)
    (s,) = run_workflow(task("calculator", QUESTION), engine, 1, LONG, limits=limits)
    assert s.truncated and s.info["finish"] == "max_tokens" and s.response_length <= 250
    assert s.action_mask[-1] == 1
    assert s.metrics["turns_cut"] >= 1  # the last turn got only the tokens that were left


def test_a_game_asking_for_more_turns_than_the_limit_fails() -> None:
    with pytest.raises(WorkflowError, match="limits.max_turns"):
        run_workflow(task("guess_number", {"target": 5, "max_turns": 9}), turns("5"), 1,
                     limits=WorkLimits(max_turns=8))


def test_the_task_reward_fn_scores_the_last_model_turn() -> None:
    engine = turns(CALL.format("23 * 47 - 81"), "It is 999")
    (s,) = run_workflow(task("calculator", QUESTION, reward_fn="format"), engine, 1, LONG)
    assert s.reward == 1.0 and not s.correct  # the format reward, not the environment's outcome


@pytest.fixture
def plugin_env():
    yield
    unregister_environment("test_counter")


class Counter(Environment):
    """Say the next number: 1, 2, 3; each right turn earns 0.5, the episode ends after three turns."""

    max_turns = 3

    def __init__(self, payload) -> None:
        super().__init__(payload)
        self.said: list[str] = []

    def opening(self):
        return [{"role": "user", "content": "Count with me, starting at 1."}]

    def step(self, text):
        self.said.append(text.strip())
        right = text.strip() == str(len(self.said))
        return Turn([{"role": "user", "content": "Next."}], reward=0.5 if right else 0.0,
                    done=len(self.said) == 3)

    def outcome(self):
        return Reward(float(self.said == ["1", "2", "3"]), correct=self.said == ["1", "2", "3"])


def test_an_environment_registered_in_code_runs_as_a_workflow(plugin_env) -> None:
    register_environment("test_counter")(Counter)
    samples = run_workflow(task("test_counter", {}), turns("1", "2", "4"), 2)
    for s in samples:
        assert s.reward == 0.0 and s.metrics["turns"] == 3 and not s.truncated
        assert sorted(r for r in s.token_rewards if r) == [0.5, 0.5]


def test_environments_are_found_by_entry_point(monkeypatch: pytest.MonkeyPatch, plugin_env) -> None:
    plugins = [EntryPoint("test_counter", f"{__name__}:Counter", registry.ENVIRONMENT_GROUP)]

    def fake_entry_points(group: str, name: str | None = None):
        return [ep for ep in plugins if ep.group == group and (name is None or ep.name == name)]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    assert "test_counter" in registry.workflow_names()
    (s,) = run_workflow(task("test_counter", {}), turns("1", "2", "3"), 1)
    assert s.reward == 1.0 and s.correct


@pytest.mark.model
def test_a_calculator_episode_on_the_tiny_model(tiny_model_dir: Path) -> None:
    engine = create_engine("transformers", tiny_model_dir)
    params = SamplingParams(max_tokens=12, seed=0)
    tasks = make_word_problems(1, seed=0)
    samples = run_workflow(tasks[0], engine, 2, params, limits=WorkLimits(max_turns=3))
    again = run_workflow(tasks[0], engine, 2, params, limits=WorkLimits(max_turns=3))
    assert [s.tokens for s in samples] == [s.tokens for s in again]
    for s in samples:
        assert len(s.action_mask) == len(s.logprobs) == s.response_length and s.action_mask[-1] == 1
        assert sum(s.action_mask) == s.metrics["model_tokens"] <= 3 * 12


# -- algorithms ----------------------------------------------------------------------------------------------------


def test_mask_truncated_keeps_truncated_rows_out_of_the_loss_but_in_the_baseline(tiny_model_dir: Path) -> None:
    from streamrft.engines.training import TrainingEngine, TrainingSettings
    from streamrft.schemas import Experience, RolloutKind, pack_f32, pack_i32

    def exp(i: int, reward: float, truncated: bool) -> Experience:
        return Experience(eid=f"e{i}", group_id="g", task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=i,
                          model_version=0, tokens=pack_i32([5, 6, 7, 8 + i, 9, 10]), prompt_length=3,
                          logprobs=pack_f32([-2.0] * 3), reward=reward, truncated=truncated)

    experiences = [exp(0, 1.0, False), exp(1, 0.0, False), exp(2, 0.0, True)]
    outcomes = {}
    for masked in (False, True):
        engine = TrainingEngine.from_pretrained(tiny_model_dir, TrainingSettings(mask_truncated=masked),
                                                device="cpu")
        batch = engine.prepare(experiences)
        outcomes[masked] = batch
    plain, masked = outcomes[False], outcomes[True]
    assert masked.response_mask[2].sum() == 0 and masked.advantages[2].abs().sum() == 0
    assert masked.metrics["actor/num_tokens"] == 6 and masked.metrics["actor/num_masked_truncated"] == 1
    # the truncated row still counted in the group's baseline: the others' advantages are unchanged
    assert torch.equal(masked.advantages[:2], plain.advantages[:2])


@pytest.mark.model
def test_an_episode_never_outgrows_the_models_positions(tmp_path: Path) -> None:
    """The engine's max_model_len (the tiny model's 256 positions here) cuts an episode before it would outgrow
    what the trainer can take: truncated, finish max_model_len, every sequence within the positions."""
    from streamrft.engines.models import build_tiny_model

    engine = create_engine("transformers", build_tiny_model(tmp_path, max_position_embeddings=256))
    assert engine.max_model_len == 256
    samples = run_workflow(task("guess_number", {"target": 1, "low": 1, "high": 9, "max_turns": 8}), engine, 3,
                           SamplingParams(max_tokens=40, seed=1), limits=WorkLimits(max_episode_tokens=4000))
    for s in samples:
        assert len(s.tokens) <= 256
        assert s.info["finish"] in ("done", "max_model_len") and s.truncated == (s.info["finish"] != "done")
    assert any(s.info["finish"] == "max_model_len" for s in samples)
    # and one turn alone stops at the positions too, as vLLM does
    (completion,) = engine.generate([[5 + i % 80 for i in range(245)]], SamplingParams(max_tokens=40, seed=0))[0]
    assert len(completion.prompt_ids) + len(completion.response_ids) <= 256
