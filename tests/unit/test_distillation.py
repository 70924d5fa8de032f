"""On-policy distillation without a broker: the ``distill`` advantage and ``distill_coef`` against hand-computed
values, teacher forcing against the engine's own logprobs, the tokenizer check, teacher logprobs batched across
workflows and carried into the experience, and a few training steps that bring the student toward the teacher."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from streamrft.engines.algorithms import distill, grpo
from streamrft.engines.inference import EngineError, SamplingParams, create_engine
from streamrft.engines.models import build_tiny_model
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines.training.batch import collate
from streamrft.engines.workflows import (
    WorkflowPool,
    WorkflowSample,
    check_same_tokenizer,
    teacher_forced_logprobs,
)
from streamrft.engines.workflows.scheduler import Driver
from streamrft.engines.workflows.teacher import TransformersScorer
from streamrft.schemas import RolloutKind, Task, unpack_f32

# fp32 on both sides; the engine's decoding loop and one teacher-forced forward differ by kernels only
LOGPROB_TOLERANCE = 1e-4


def experience(tokens, prompt_length, logprobs, teacher=None, reward=0.0, group="g", eid="e"):
    sample = WorkflowSample(tokens=tokens, prompt_length=prompt_length, logprobs=logprobs, reward=reward,
                            teacher_logprobs=teacher)
    return sample.to_experience(eid=eid, group_id=group, task_id="t", step=0, kind=RolloutKind.TRAIN, run_index=0)


def modelless(**algorithm) -> TrainingEngine:
    """An engine whose ``prepare`` needs no model: the behaviour logprobs stand for the old ones."""
    return TrainingEngine(torch.nn.Linear(1, 1), TrainingSettings(recompute_old_logprobs=False, **algorithm),
                          device="cpu")


# -- the advantage, by hand ------------------------------------------------------------------------------------


def test_distill_coef_adds_the_distill_term_to_the_task_advantage():
    rewards, mask = torch.tensor([1.0, 0.0]), torch.ones(2, 2)
    behaviour, teacher = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]]), torch.tensor([[-0.5, -3.0], [-2.0, -0.5]])
    engine = modelless(distill_coef=0.5)
    # grpo of [1, 0]: ±(1 − 0.5) / (std + ε), std = 0.7071 (unbiased); plus 0.5 × (teacher − behaviour)
    task = 0.5 / (0.70710678 + 1e-6)
    expected = torch.tensor([[task + 0.25, task - 1.0], [-task + 0.0, -task + 0.0]])
    prepared = engine.prepare(collate([
        experience([1, 2, 3, 4], 2, behaviour[0].tolist(), teacher[0].tolist(), reward=1.0, group="g", eid="a"),
        experience([1, 2, 5, 6], 2, behaviour[1].tolist(), teacher[1].tolist(), reward=0.0, group="g", eid="b"),
    ]))
    assert torch.allclose(prepared.advantages, expected, atol=1e-5)
    assert torch.allclose(grpo(rewards, mask, ["g", "g"]) + 0.5 * distill(
        rewards, mask, ["g", "g"], teacher_logprobs=teacher, behaviour_logprobs=behaviour), expected, atol=1e-5)
    # distill/kl: mean over trained tokens of behaviour − teacher = (−0.5 + 2 + 0 + 0) / 4
    assert prepared.metrics["distill/kl"] == pytest.approx(0.375)


def test_rows_without_teacher_logprobs_stay_out_of_a_distillation_step():
    batch = modelless(advantage="distill").prepare(collate([
        experience([1, 2, 3], 2, [-1.0], [-0.25], eid="a", group="a"),
        experience([1, 2, 4], 2, [-2.0], None, eid="b", group="b"),  # e.g. written by serve mode
    ]))
    assert batch.response_mask.tolist() == [[1.0], [0.0]] and batch.advantages.tolist() == [[0.75], [0.0]]
    assert batch.metrics["distill/rows_without_teacher"] == 1.0 and batch.metrics["distill/kl"] == -0.75


def test_distill_and_distill_coef_together_are_refused_and_teacher_inputs_are_no_params():
    with pytest.raises(ValueError, match="set one of them"):
        TrainingSettings(advantage="distill", distill_coef=1.0)
    with pytest.raises(ValueError, match="not parameters of advantage 'distill'"):
        TrainingSettings(advantage="distill", advantage_params={"teacher_logprobs": 1})
    assert TrainingSettings(advantage="distill").uses_teacher and TrainingSettings(distill_coef=0.1).uses_teacher
    assert not TrainingSettings().uses_teacher


def test_teacher_logprobs_travel_from_sample_to_experience_to_batch():
    exp = experience([1, 2, 3, 4, 5], 2, [-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0])
    assert unpack_f32(exp.teacher_logprobs).tolist() == [-0.5, -0.25, -4.0]
    batch = collate([exp, experience([1, 2], 1, [-1.0])])
    assert batch.teacher_logprobs.tolist() == [[-0.5, -0.25, -4.0], [0.0, 0.0, 0.0]]
    assert batch.has_teacher.tolist() == [True, False]
    assert batch.select([1]).teacher_logprobs.tolist() == [[0.0]]
    with pytest.raises(ValueError, match="2 teacher logprobs for 3 response tokens"):
        WorkflowSample([1, 2, 3, 4, 5], 2, [-1.0] * 3, 0.0, teacher_logprobs=[-1.0, -1.0]).validate()


# -- teacher forcing ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return create_engine("transformers", tiny_model_dir)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny architecture with other weights (and the same tokenizer)."""
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=3, initializer_range=0.3)


@pytest.mark.model
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_forcing_the_policy_gives_back_its_own_sampling_logprobs(policy, temperature):
    """The teacher's numbers are the trainer's numbers: scoring a sample under the model that drew it returns the
    logprobs it was drawn with (so a teacher equal to the student gives a distill advantage of 0)."""
    completions = [c for row in policy.generate([[{"role": "user", "content": "What is 3 + 4?"}], [5, 9, 11, 2]],
                                                SamplingParams(temperature=temperature, max_tokens=12, seed=2), n=3)
                   for c in row]
    scored = teacher_forced_logprobs(policy.model, [c.prompt_ids + c.response_ids for c in completions],
                                     [len(c.prompt_ids) for c in completions], temperature, max_tokens=40)
    for completion, logprobs in zip(completions, scored):
        assert len(logprobs) == len(completion.response_ids)
        assert logprobs == pytest.approx(completion.logprobs, abs=LOGPROB_TOLERANCE)


@pytest.mark.model
def test_a_teacher_with_another_tokenizer_is_refused_saying_why(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(other)
    same = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_same_tokenizer(same, AutoTokenizer.from_pretrained(tiny_model_dir), "teacher")  # no error
    with pytest.raises(EngineError, match=r"'big' cannot be the teacher: its tokenizer is not the policy's .*"
                                          r"1 differ, e.g. \['<tool>'\]"):
        check_same_tokenizer(same, AutoTokenizer.from_pretrained(other), "big")


@pytest.mark.model
def test_the_teacher_scores_every_workflows_samples_in_one_forward_and_a_failed_sample_gets_none(
        policy, teacher_dir):
    import itertools

    teacher = create_engine("transformers", teacher_dir)
    judged = itertools.count()
    judge = create_engine("fake", responder=lambda prompt, j: "no idea" if next(judged) == 0 else "Score: 5")
    tasks = [Task(task_id=f"t{i}", workflow="arithmetic", reward_fn="judge",
                  payload=json.dumps({"question": f"What is {i} + 1?", "answer": i + 1})) for i in range(3)]
    pool = WorkflowPool(policy)
    pool.attach({"teacher": teacher, "judge": judge}, teacher="teacher")
    for i, one in enumerate(tasks):
        pool.start(i, one, 2, SamplingParams(max_tokens=6, seed=1))
    outcomes = {}
    while pool.running:
        outcomes.update(pool.drive(timeout=1.0))
    lanes = {lane.name: lane.calls_per_step for lane in pool.driver.lanes}
    assert lanes == {"policy": [3], "teacher": [], "judge": [3], "teacher/logprobs": [3]}  # one batch each
    samples = [s for i in range(3) for s in outcomes[i]]
    failed = [s for s in samples if s.failure is not None]
    assert len(failed) == 1 and failed[0].teacher_logprobs is None
    for sample in samples:
        if sample.failure is None:
            expected = teacher_forced_logprobs(teacher.model, [sample.tokens], [sample.prompt_length])[0]
            assert sample.teacher_logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
            assert sample.teacher_logprobs != pytest.approx(sample.logprobs, abs=0.1)  # another model's numbers


def test_a_teacher_name_the_run_lacks_or_an_engine_that_cannot_score_is_refused_when_attached():
    pool = WorkflowPool(create_engine("fake"))
    with pytest.raises(KeyError, match="distillation.teacher asks for auxiliary model 'big'; this run has: judge"):
        pool.attach({"judge": create_engine("fake")}, teacher="big")
    with pytest.raises(EngineError, match="fake engine cannot score given tokens"):
        WorkflowPool(create_engine("fake")).attach({"judge": create_engine("fake")}, teacher="judge")


def test_a_scorer_call_that_breaks_the_model_fails_alone():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask):
            if (input_ids == 99).any():
                raise IndexError("token 99 is out of range")
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 4)})()

    engine = type("Engine", (), {"model": Model(), "pad_token_id": 0, "kind": "transformers"})()
    scorer = TransformersScorer(engine)
    driver = Driver()
    lane = driver.lane("teacher", scorer)
    scorer.submit("good", [[1, 2, 3]], [1], 1.0)
    scorer.submit("bad", [[1, 99]], [1], 1.0)
    results = dict(scorer.step())
    assert results["good"] == [[pytest.approx(-1.3862944), pytest.approx(-1.3862944)]]  # log(1/4)
    assert isinstance(results["bad"], IndexError) and lane.waiting == 0


# -- the direction -------------------------------------------------------------------------------------------


def test_in_expectation_over_the_students_tokens_the_distill_gradient_is_the_reverse_kl_gradient():
    """One position, a student ``softmax(θ)`` and a teacher ``q``: the policy-gradient loss (ppo_clip, on-policy
    so the ratio is 1) with the distill advantage, averaged over every token the student could sample weighted by
    its probability, has exactly the gradient of ``KL(p_θ ‖ q)``: the advantage points down the reverse KL."""
    from streamrft.engines.algorithms import ppo_clip

    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=generator, requires_grad=True)
    log_q = torch.log_softmax(torch.randn(7, generator=generator) * 3, -1)
    log_p = torch.log_softmax(theta, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum()
    (expected,) = torch.autograd.grad(kl, theta, retain_graph=True)

    every_token = log_p[None, :]  # [1, V]: each vocabulary entry as if it were the sampled token
    advantage = distill(torch.zeros(1), torch.ones(1, 7), ["g"], teacher_logprobs=log_q[None, :],
                        behaviour_logprobs=every_token.detach())
    token_loss = ppo_clip(every_token, every_token.detach(), advantage, torch.ones(1, 7)).token_loss
    (got,) = torch.autograd.grad((token_loss * log_p.exp().detach()).sum(), theta)
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    assert float(expected.norm()) > 0.1  # a teacher the student is far from
