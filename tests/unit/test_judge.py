"""The judge reward (engines/workflows/judge.py) and how workflows reach auxiliary models by name: the score
parser, the prompt template, failed samples with their reason, unknown models and bad templates failing the task
before anything is generated, and the judge calls of many workflows batched into one engine call."""
from __future__ import annotations

import json

import pytest

from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.workflows import (
    JudgeSettings,
    RewardFailure,
    WorkflowError,
    WorkflowPool,
    parse_score,
    run_workflow,
)
from streamrft.engines.workflows.auxiliary import AuxiliaryModels, UnknownAuxiliaryModel, WorkflowContext
from streamrft.schemas import Task


def judged(question: str = "What is 2 + 2?", **payload) -> Task:
    return Task(task_id="t1", workflow="arithmetic", reward_fn="judge",
                payload=json.dumps({"question": question, "answer": 4, **payload}))


def policy(*answers: str):
    """A fake policy answering sample j with answers[j]."""
    return create_engine("fake", responder=lambda prompt, j: answers[j])


def judge_engine(verdicts: dict[str, str], seen: list[str] | None = None):
    """A fake judge that answers with the verdict of the first key found in its prompt (and records prompts)."""
    def answer(prompt: str, _: int) -> str:
        if seen is not None:
            seen.append(prompt)
        return next(verdict for key, verdict in verdicts.items() if key in prompt)

    return create_engine("fake", responder=answer)


# -- the score parser -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, value, correct, score", [
    ("Score: 10", 1.0, True, 10.0),
    ("The response is fine.\nscore = 7.5", 0.75, False, 7.5),
    ("Score: 2 at first, but on reflection Score: 6", 0.6, False, 6.0),  # the last score counts
    ("SCORE:0", 0.0, False, 0.0),
])
def test_a_judge_answer_gives_its_last_score_scaled_to_one(answer, value, correct, score):
    reward = parse_score(answer, JudgeSettings())
    assert reward.value == pytest.approx(value) and reward.correct is correct
    assert reward.metrics == {"judge/score": score} and reward.info["judge_answer"] == answer


@pytest.mark.parametrize("answer, reason", [
    ("It is a good answer.", "no score in the judge's answer"),
    ("Score: 11", r"outside \[0, 10\]"),
    ("Score: -1", r"outside \[0, 10\]"),
])
def test_an_answer_without_a_usable_score_is_a_failure_with_its_reason_not_a_zero(answer, reason):
    with pytest.raises(RewardFailure, match=reason) as caught:
        parse_score(answer, JudgeSettings())
    assert caught.value.source == "judge" and answer[:10] in str(caught.value)


def test_the_parser_and_the_range_are_configurable():
    settings = JudgeSettings(score_pattern=r"\[\[(\d)\]\]", min_score=1, max_score=5, pass_score=4)
    assert parse_score("Verdict: [[4]]", settings).value == pytest.approx(0.75)
    assert parse_score("Verdict: [[4]]", settings).correct
    assert not parse_score("[[3]]", settings).correct
    whole_match = JudgeSettings(score_pattern=r"\d+")  # no group: the whole match is the score
    assert parse_score("between 3 and 8", whole_match).value == pytest.approx(0.8)


@pytest.mark.parametrize("settings, message", [
    ({"score_pattern": "(unclosed"}, "not a regular expression"),
    ({"min_score": 5, "max_score": 5}, "must be above min_score"),
    ({"pass_score": 11}, "pass_score"),
    ({"prompt_template": "Rate {} please"}, "need names"),
    ({"prompt_template": "Rate {response"}, "not a format string"),
])
def test_bad_judge_settings_are_refused_saying_why(settings, message):
    with pytest.raises(ValueError, match=message):
        JudgeSettings(**settings)


# -- the reward in a workflow ------------------------------------------------------------------------------------


def test_the_judge_sees_the_question_the_response_and_payload_fields_of_its_template():
    seen: list[str] = []
    settings = JudgeSettings(prompt_template="Q={question} R={response} ref={answer} rubric={rubric} "
                                             "scale {min_score}-{max_score}", system_prompt="You grade.")
    context = WorkflowContext.of(AuxiliaryModels({"judge": judge_engine({"R=": "Score: 8"}, seen)}), settings)
    (sample,) = run_workflow(judged(rubric="be exact"), policy("four"), 1, context=context)
    assert sample.reward == pytest.approx(0.8) and sample.failure is None
    assert "Q=What is 2 + 2? R=four ref=4 rubric=be exact scale 0-10" in seen[0]
    assert "You grade." in seen[0]  # the system message, through the judge's chat template
    assert sample.metrics["judge/score"] == 8.0 and sample.info["judge_answer"] == "Score: 8"


def test_a_sample_the_judge_cannot_score_fails_alone_with_its_reason():
    judge = judge_engine({"good": "Score: 9", "odd": "I refuse to grade this.", "so-so": "Score: 4"})
    context = WorkflowContext.of(AuxiliaryModels({"judge": judge}))
    samples = run_workflow(judged(), policy("good", "odd", "so-so"), 3, context=context)
    assert [s.reward for s in samples] == [pytest.approx(0.9), 0.0, pytest.approx(0.4)]
    assert samples[0].failure is None and samples[2].failure is None
    assert "no score in the judge's answer" in str(samples[1].failure) and "I refuse" in str(samples[1].failure)
    with pytest.raises(ValueError, match="not an experience"):  # a failed sample can never become training data
        samples[1].to_experience(eid="e", group_id="g", task_id="t", step=0, kind="TRAIN", run_index=1)


def test_a_task_may_name_another_judge_model():
    context = WorkflowContext.of(AuxiliaryModels({"judge": judge_engine({"": "Score: 1"}),
                                                  "strict": judge_engine({"": "Score: 0"})}))
    (lenient,) = run_workflow(judged(), policy("x"), 1, context=context)
    (strict,) = run_workflow(judged(judge_model="strict"), policy("x"), 1, context=context)
    assert lenient.reward == pytest.approx(0.1) and strict.reward == 0.0


def test_an_unknown_judge_model_fails_the_task_before_anything_is_generated():
    engine = policy("x")
    context = WorkflowContext.of(AuxiliaryModels({"judge": judge_engine({"": "Score: 1"})}))
    with pytest.raises(WorkflowError, match="asks for auxiliary model 'grader'; this run has: judge") as caught:
        run_workflow(judged(judge_model="grader"), engine, 1, context=context)
    assert isinstance(caught.value.__cause__, UnknownAuxiliaryModel)
    with pytest.raises(WorkflowError, match="this run has: none"):
        run_workflow(judged(), engine, 1)  # no auxiliary models at all
    assert engine.calls == 0


def test_a_template_field_the_payload_lacks_fails_the_task_before_anything_is_generated():
    engine = policy("x")
    context = WorkflowContext.of(AuxiliaryModels({"judge": judge_engine({"": "Score: 1"})}),
                                 JudgeSettings(prompt_template="{response} against {rubric}"))
    with pytest.raises(WorkflowError, match=r"names \{rubric\}, which the task payload does not have"):
        run_workflow(judged(), engine, 1, context=context)
    assert engine.calls == 0


def test_a_plugin_workflow_reaches_auxiliary_models_by_name(plugin_names):
    from streamrft.engines.workflows import SingleTurnWorkflow, register_workflow

    @register_workflow("test_rewriter")
    class Rewriter(SingleTurnWorkflow):
        default_reward = "format"

        def messages(self, payload):
            (draft,) = self.context.auxiliary[payload["helper"]].generate(
                [[{"role": "user", "content": "draft"}]], SamplingParams(max_tokens=8))[0]
            return [{"role": "user", "content": f"improve: {draft.text}"}]

    seen: list[str] = []
    context = WorkflowContext.of(AuxiliaryModels({"helper": judge_engine({"": "a draft"})}))
    engine = create_engine("fake", responder=lambda prompt, j: seen.append(prompt) or "7")
    task = Task(task_id="t", workflow="test_rewriter", payload=json.dumps({"helper": "helper"}))
    (sample,) = run_workflow(task, engine, 1, context=context)
    assert "improve: a draft" in seen[0] and sample.reward == 1.0
    missing = Task(task_id="t", workflow="test_rewriter", payload=json.dumps({"helper": "nobody"}))
    with pytest.raises(WorkflowError, match="auxiliary model 'nobody'; this run has: helper"):
        run_workflow(missing, engine, 1, context=context)


@pytest.fixture
def plugin_names():
    from streamrft.engines.workflows import unregister_workflow

    yield
    unregister_workflow("test_rewriter")


# -- batching --------------------------------------------------------------------------------------------------


def test_the_judge_calls_of_every_workflow_share_one_engine_call():
    judge = judge_engine({"": "Score: 5"})
    tasks = [judged(f"What is {i} + 1?") for i in range(5)]
    pool = WorkflowPool(policy("a", "b", "c"))
    context = pool.attach({"judge": judge})
    for i, one in enumerate(tasks):
        pool.start(i, one, 3, SamplingParams())
    outcomes = []
    while pool.running:
        outcomes += pool.drive(timeout=1.0)
    assert len(outcomes) == 5 and all(len(samples) == 3 for _, samples in outcomes)
    assert pool.shared.calls_per_step == [5]  # the policy: five tasks in one batch
    assert context.auxiliary["judge"].calls_per_step == [5] and judge.calls == 1  # 15 answers judged at once


def test_beside_an_incremental_policy_the_judge_does_not_wait_for_the_slowest_generation():
    """vLLM-like policy: its calls come back one by one; a workflow blocked in the policy's running batch counts as
    waiting, so a judge call goes at once instead of waiting for every workflow to reach the judge."""
    incremental = create_engine("fake", latency_s=0.05, incremental=True, responder=lambda p, j: "ok")
    judge = judge_engine({"": "Score: 7"})
    pool = WorkflowPool(incremental)
    context = pool.attach({"judge": judge})
    for i, repeat in enumerate([1, 2, 3, 4]):  # 50 to 200 ms of generation
        pool.start(i, judged(f"What is {i} + 1?"), repeat, SamplingParams())
    outcomes = []
    while pool.running:
        outcomes += pool.drive(timeout=1.0)
    assert sorted(len(samples) for _, samples in outcomes) == [1, 2, 3, 4]
    assert {s.reward for _, samples in outcomes for s in samples} == {0.7}
    steps = context.auxiliary["judge"].calls_per_step
    assert sum(steps) == 4 and len(steps) >= 2, steps  # judged as each finished, not all after the slowest
