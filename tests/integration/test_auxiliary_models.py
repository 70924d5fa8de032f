"""Auxiliary models through the loop on the real broker, with tiny real models: an LLM judge's rewards (and its
failures, visible in the results, the dead letters and the counters), on-policy distillation whose student moves
toward its teacher (the reverse KL on held-out prompts falls), and a teacher of another tokenizer refused at the
worker's start."""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from bench.distillation import held_out_kl, sft_tiny, student_and_teacher
from streamrft.consumers.explorer import Explorer
from streamrft.consumers.rollout import RolloutWorker
from streamrft.consumers.trainer import Trainer
from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.workflows import JudgeSettings, judge_sampling, parse_score, teacher_forced_logprobs
from streamrft.engines.workflows.auxiliary import AuxiliaryModels, WorkflowContext
from streamrft.engines.workflows.judge import JudgeReward
from streamrft.errors import ConfigError
from streamrft.kafka import KafkaClients
from streamrft.kafka.reader import read_topic
from streamrft.lifecycle import StopSignal
from streamrft.schemas import (Experience, Metric, RolloutKind, RolloutRequest, RolloutResult, RolloutStatus, Task,
                               unpack_f32)

from .roles import RoleThread, produce_tasks, read_all, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.model]

JUDGE = {"model": "judge", "prompt_template": "Q: {question}\nA: {response}\nGrade it.", "max_tokens": 10,
         "temperature": 1.0, "seed": 0}


def _clients(config) -> KafkaClients:
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    return clients


def judge_example(rng: random.Random) -> tuple[list[dict], str]:
    """A judge prompt of the test's template on a random answer, graded with a random score 0-9."""
    answer = "".join(rng.choice("0123456789 abcdefxyz.") for _ in range(rng.randint(1, 12)))
    content = JUDGE["prompt_template"].format(question=f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}?",
                                              response=answer)
    return [{"role": "user", "content": content}], f"Score: {rng.randint(0, 9)}"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    """A tiny judge fine-tuned briefly to answer 'Score: <digit>': sampled at temperature 1 it keeps to the format
    most of the time, not always -- so both a score and an answer without one come up."""
    return sft_tiny(tmp_path_factory.mktemp("judge"), 60, seed=5, example=judge_example)


def arithmetic(i: int, **extra) -> Task:
    a, b = 3 * i, i + 1
    return Task(task_id=f"t{i}", workflow="arithmetic", reward_fn="judge",
                payload=json.dumps({"question": f"What is {a} + {b}?", "answer": a + b, **extra}))


def test_judge_rewards_through_the_loop_and_its_failures_in_the_results(run_config, tiny_model_dir, judge_dir):
    """8 tasks judged by the tiny judge (4 samples each), one naming a judge the run lacks, one judged by a
    model that never writes a score. Checked: every experience's reward is the score of the judge's answer it
    carries, and that answer is what the judge model says to that prompt (re-asked here); a sample without a
    score is no experience and its result names it; a request with none scored and one naming an unknown model
    FAIL with their reasons and are dead-lettered; the counters count the failures."""
    config = run_config(
        model={"path": str(tiny_model_dir)},
        auxiliary_models={"judge": {"model": str(judge_dir)}, "mute": {"model": str(tiny_model_dir)}},
        judge=JUDGE,
        sync={"style": "fully_async", "max_staleness": 100},
        explorer={"batch_size": 10, "repeat_times": 4, "max_steps": 1, "metrics_port": None},
        rollout={"sampling": {"max_tokens": 6, "seed": 0}, "metrics_port": None},
    )
    clients = _clients(config)
    tasks = [arithmetic(i) for i in range(8)] + [arithmetic(8, judge_model="nobody"),
                                                 arithmetic(9, judge_model="mute")]
    produce_tasks(clients, config, tasks)
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    wait_for(explorer, [worker], 240)
    worker.stop.request()
    worker.join(60)

    results = {r.task_id: r for r in read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult)}
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert results["t8"].status == RolloutStatus.FAILED
    assert "asks for auxiliary model 'nobody'; this run has: judge, mute" in results["t8"].error
    assert results["t9"].status == RolloutStatus.FAILED
    assert "4 of 4 sample(s) not scored" in results["t9"].error and "no score in the judge's answer" in \
        results["t9"].error
    letters = {clients.serde.decode(r.value, config.topic("rollouts")).task.task_id:
               {k: v.decode() for k, v in r.headers}
               for r in read_topic(config.kafka, clients.bootstrap, config.topic("rollouts") + ".dlq", idle_timeout=2)}
    assert letters["t8"]["streamrft.reason"] == "workflow-error"
    assert letters["t9"]["streamrft.reason"] == "reward-failed" and set(letters) == {"t8", "t9"}

    failed = 0
    for i in range(8):
        result = results[f"t{i}"]
        assert result.status == RolloutStatus.OK, result.error
        unscored = [int(n) for n in re.findall(r"sample (\d): judge: ", result.error or "")]
        failed += len(unscored)
        mine = [e for e in experiences if e.task_id == f"t{i}"]
        assert result.n == len(mine) == 4 - len(unscored) and all(e.group_size == result.n for e in mine)
        assert not {int(e.eid.rsplit("/", 1)[1]) for e in mine} & set(unscored)  # a failed sample: no experience
    assert 0 < failed < 32 and len(experiences) == 32 - failed, failed  # both outcomes came up

    judge = WorkflowContext.of(AuxiliaryModels({"judge": create_engine("transformers", judge_dir)}),
                               JudgeSettings(**JUDGE))
    payloads = {t.task_id: json.loads(t.payload) for t in tasks}
    asked = [JudgeReward(judge, payloads[e.task_id]).messages(e.prompt_text, e.response_text, payloads[e.task_id])
             for e in experiences]
    replies = judge.auxiliary["judge"].generate(asked, [judge_sampling(judge.judge, m[-1]["content"]) for m in asked])
    for e, (reply,) in zip(experiences, replies):
        answer = e.info["judge_answer"]
        assert reply.text == answer  # the judge model said it (asked again here): nothing made up on the way
        assert e.reward == pytest.approx(parse_score(answer, judge.judge).value) and e.reward == \
            pytest.approx(e.metrics["judge/score"] / 10)

    assert worker.role.metrics.failed_samples.labels("judge")._value.get() == failed + 4
    metrics = read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
    assert sum(m.value for m in metrics if m.name == "judge/failed_samples") == failed + 4
    clients.close()


@pytest.fixture(scope="module")
def student_teacher(tmp_path_factory) -> tuple[Path, Path]:
    return student_and_teacher(tmp_path_factory.mktemp("distill"))


def test_distillation_through_the_loop_brings_the_student_toward_its_teacher(run_config, student_teacher,
                                                                            tmp_path):
    """Explorer, a worker with the teacher as an auxiliary model, a trainer with ``advantage: distill``, 16
    steps on-policy. Checked: every experience carries the teacher's teacher-forced logprobs of its response
    tokens; the trainer reports distill/kl; the exact reverse KL to the teacher on held-out prompts, on the
    student's own samples, falls by a third."""
    from transformers import AutoModelForCausalLM

    from streamrft.engines.tasks import make_arithmetic_tasks

    student, teacher = student_teacher
    steps = 16
    config = run_config(
        model={"path": str(student)},
        auxiliary_models={"teacher": {"model": str(teacher)}},
        distillation={"teacher": "teacher"},
        sync={"style": "fixed", "interval": 1},
        explorer={"batch_size": 16, "repeat_times": 4, "max_steps": steps, "metrics_port": None},
        rollout={"sampling": {"max_tokens": 8, "seed": 0}, "metrics_port": None},
        trainer={"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_port": None, "device": "cpu", "lr": 1e-3,
                 "micro_batch_size": 64, "total_steps": steps, "save_interval": 100,
                 "algorithm": {"advantage": "distill"}},
    )
    clients = _clients(config)
    produce_tasks(clients, config, make_arithmetic_tasks(16 * steps, seed=3, low=0, high=50))
    worker = RoleThread("worker", lambda stop: RolloutWorker(config, clients, stop, "w0")).start()
    explorer = RoleThread("explorer", lambda stop: Explorer(config, clients, stop)).start()
    trainer = RoleThread("trainer", lambda stop: Trainer(config, clients, stop)).start()
    try:
        wait_for(trainer, [worker, explorer], 400)
        wait_for(explorer, [worker], 60)
    finally:
        for role in (worker, explorer, trainer):
            role.stop.request()
        worker.join(60)
    assert trainer.result == steps

    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience)
    assert len(experiences) == 16 * 4 * steps
    for e in experiences[::97]:
        expected = teacher_forced_logprobs(teacher_model, [e.token_array.tolist()], [e.prompt_length])[0]
        assert unpack_f32(e.teacher_logprobs).tolist() == pytest.approx(expected, abs=1e-4)
    kl = [m.value for m in read_all(config, clients.bootstrap, "metrics", clients.serde, Metric)
          if m.name == "distill/kl"]
    assert len(kl) == steps

    engine = create_engine("transformers", student)
    before = held_out_kl(engine, teacher_model)
    engine.load_weights(trainer.role.engine.named_weights(), steps)
    after = held_out_kl(engine, teacher_model)
    print(f"held-out reverse KL to the teacher: {before:.3f} -> {after:.3f} nats/token after {steps} steps")
    assert after < 0.67 * before, (before, after)
    clients.close()


def test_a_teacher_with_another_tokenizer_stops_the_worker_at_start(run_config, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(other)
    config = run_config(model={"path": str(tiny_model_dir)}, auxiliary_models={"big": {"model": str(other)}},
                        distillation={"teacher": "big"}, rollout={"metrics_port": None})
    clients = _clients(config)
    with pytest.raises(ConfigError, match="distillation.teacher: auxiliary model 'big' cannot be the teacher: its "
                                          "tokenizer is not the policy's"):
        RolloutWorker(config, clients, StopSignal(), "w0")
    clients.close()


@pytest.fixture(scope="module")
def vllm_judge(judge_dir):
    """The tiny judge on vLLM's engine (the CPU build here), built as a worker builds an auxiliary model."""
    from streamrft.config.auxiliary import AuxiliaryModelConfig
    from streamrft.consumers.rollout.auxiliary import build_auxiliary_engine

    settings = AuxiliaryModelConfig(engine="vllm", model=str(judge_dir), dtype="float32", max_batch_size=64,
                                    vllm={"kv_cache_gib": 1, "enforce_eager": True, "max_model_len": 512})
    engine = build_auxiliary_engine("judge", settings, str(judge_dir))
    yield engine
    engine.close()


@pytest.mark.vllm
def test_a_vllm_judge_beside_the_transformers_policy_judges_as_the_transformers_engine_does(tiny_model_dir,
                                                                                          judge_dir, vllm_judge):
    """vLLM as an auxiliary model: its lane steps it as it steps the rollout engine (an incremental one, every
    step while it has calls), the judge calls of all workflows join its batch, and with greedy judging the
    rewards are those of the same judge on the transformers engine."""
    from streamrft.engines.workflows import run_workflows

    assert vllm_judge.kind == "vllm"
    policy = create_engine("transformers", tiny_model_dir)
    tasks = [arithmetic(i) for i in range(6)]
    params = SamplingParams(max_tokens=6, seed=0)
    greedy = JudgeSettings(**{**JUDGE, "temperature": 0.0})
    on_vllm = run_workflows(tasks, policy, 3, params, auxiliary={"judge": vllm_judge}, judge=greedy)
    on_transformers = run_workflows(tasks, policy, 3, params,
                                    auxiliary={"judge": create_engine("transformers", judge_dir)}, judge=greedy)
    for vllm_samples, hf_samples in zip(on_vllm, on_transformers):
        assert [s.tokens for s in vllm_samples] == [s.tokens for s in hf_samples]  # the same policy samples
        assert [s.info.get("judge_answer") for s in vllm_samples] == [s.info.get("judge_answer") for s in hf_samples]
        assert [s.reward for s in vllm_samples] == [s.reward for s in hf_samples]
    assert any(s.failure is None for samples in on_vllm for s in samples)  # some answers gave a score


def test_a_judge_reached_by_url_scores_through_streamrfts_own_server(run_config, tiny_model_dir, judge_dir,
                                                                     tmp_path):
    """``engine: openai``: the judge is `streamrft serve` in front of the judge model; a rollout worker's judge
    calls go over HTTP (bearer key from the config's secret), and every reward is the score of what the served
    judge model says to that prompt (asked again here, on the model itself, with the judge's seed)."""
    from .test_serve import KEY, serve_config, serving

    server_config = serve_config(run_config, judge_dir, tmp_path)
    with serving(server_config) as (_, _, base, _):
        config = run_config(
            model={"path": str(tiny_model_dir)},
            auxiliary_models={"judge": {"engine": "openai", "model": "tiny", "base_url": f"{base}/v1",
                                        "api_key": KEY, "tokenizer": str(judge_dir)}},
            judge=JUDGE, rollout={"sampling": {"max_tokens": 6, "seed": 0}, "metrics_port": None})
        clients = _clients(config)
        producer = clients.producer()
        task = arithmetic(1)
        producer.produce(config.topic("rollouts"), RolloutRequest(request_id="r0", step=0, kind=RolloutKind.TRAIN,
                                                                  task=task, repeat_times=4))
        producer.flush()
        worker = RolloutWorker(config, clients, StopSignal(signals=()), "judged-over-http")
        try:
            assert worker.run(max_requests=1) == 1
        finally:
            worker.close()
    (result,) = read_all(config, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)
    experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
    assert result.status == RolloutStatus.OK and result.n == len(experiences) > 0
    judge = WorkflowContext.of(AuxiliaryModels({"judge": create_engine("transformers", judge_dir)}),
                               JudgeSettings(**JUDGE))
    payload = json.loads(task.payload)
    for e in experiences:
        messages = JudgeReward(judge, payload).messages(e.prompt_text, e.response_text, payload)
        (reply,) = judge.auxiliary["judge"].generate([messages], judge_sampling(judge.judge, messages[-1]["content"]))[0]
        assert e.info["judge_answer"] == reply.text and e.reward == parse_score(reply.text, judge.judge).value
    clients.close()
