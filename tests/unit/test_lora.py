"""LoRA: the trainer trains, checkpoints and publishes the adapters alone; a worker merges a published adapter
into its base weights and then generates as the merged model does; one that cannot apply an adapter refuses it
and keeps what it serves; ``streamrft export`` writes a plain model. No broker."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from streamrft.config import load_config
from streamrft.engines.inference import SamplingParams, create_engine
from streamrft.engines.lora import AdapterMerger, LoraSettings, adapter_module, read_base_weights
from streamrft.engines.training import TrainingEngine, TrainingSettings
from streamrft.engines.weights.export import export_version
from streamrft.engines.weights.object_store import ObjectStore
from streamrft.schemas import SyncKind, SyncMethod, SyncSignal
from streamrft.weights.follower import WeightFollower
from tests.unit.test_training_engine import make_exp, sample, tiny_llama

pytestmark = pytest.mark.model

LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
LINEAGE = "20260101T000000-lora"
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def lora_engine(model_dir: Path, lora: LoraSettings = LORA, **settings) -> TrainingEngine:
    return TrainingEngine.from_pretrained(model_dir, TrainingSettings(micro_batch_size=4, **settings),
                                          device="cpu", lora=lora)


def trained_adapter(engine: TrainingEngine, seed: int = 0) -> None:
    """Give every B a visible value (peft starts B at zero: the adapter would change nothing yet)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in engine.named_weights():
            if adapter_module(name)[1] == "B":
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 2.0)


def publish(engine: TrainingEngine, store_dir: Path, version: int):
    store = ObjectStore(store_dir.as_uri(), lineage=LINEAGE, keep_last=5)
    published = store.publish(engine.named_weights(), version=version, metadata=engine.publish_metadata())
    signal = SyncSignal(kind=SyncKind.WEIGHTS_PUBLISHED, version=version, method=SyncMethod.OBJECT_STORE,
                        uri=published.uri, sha256=published.sha256, nbytes=published.nbytes, source="trainer",
                        lineage=LINEAGE)
    return published, signal


class View:
    def __init__(self, signal: SyncSignal):
        self.weights, self.collective_ready = signal, None

    def poll(self, timeout: float = 0.0):
        return []


def follower_for(model_dir: Path, store_dir: Path, lora: LoraSettings | None = LORA):
    config = load_config(overrides={"name": "t-lora", "model": {"path": str(model_dir),
                                                                "lora": lora.model_dump() if lora else None},
                                    "trainer": {"weights": {"url": store_dir.as_uri()}}}, env={})
    engine = create_engine("transformers", model_dir, device="cpu")
    registry = CollectorRegistry()
    return WeightFollower(config, engine, "w0", registry), engine, registry


def greedy(engine, question: str = "12+7=") -> tuple[list[int], list[float]]:
    """The greedy answer and its logprobs (a random tiny model may answer the same tokens with other weights)."""
    completion = engine.generate_one([{"role": "user", "content": question}], GREEDY)[0]
    return completion.response_ids, completion.logprobs


def assert_same_answer(a, b) -> None:
    assert a[0] == b[0]
    torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- trainer side
def test_only_the_adapters_train_and_are_published(tiny_model_dir: Path, tmp_path: Path):
    engine = lora_engine(tiny_model_dir, lr=1e-2)
    base_before = {n: t.clone() for n, t in engine.model.get_base_model().state_dict().items() if "lora_" not in n}
    metrics = engine.train_step([make_exp([5, 6, 7, 8], 2, 1.0, "a"), make_exp([5, 6, 9], 2, 0.0, "a")])
    assert engine.step == 1 and metrics["actor/grad_norm"] > 0

    published = dict(engine.named_weights())
    trainable, _ = engine.model.get_nb_trainable_parameters()
    assert all(adapter_module(name) for name in published)  # adapter tensors only, base-model names
    assert sum(t.numel() for t in published.values()) == trainable
    assert {adapter_module(n)[0].rsplit(".", 1)[1] for n in published} == {"q_proj", "v_proj"}
    for name, tensor in engine.model.get_base_model().state_dict().items():
        if "lora_" not in name:
            assert torch.equal(tensor, base_before[name]), f"{name}: a frozen base weight changed"

    out, _ = publish(engine, tmp_path / "store", 1)
    full_model_bytes = sum(t.numel() * t.element_size() for t in base_before.values())
    assert trainable * 4 <= out.nbytes < trainable * 4 + 16 << 10  # fp32 adapters + headers and manifest
    assert out.nbytes < full_model_bytes / 10


def test_the_checkpoint_holds_the_adapters_and_resumes_them(tiny_model_dir: Path, tmp_path: Path):
    engine = lora_engine(tiny_model_dir, lr=1e-2)
    engine.train_step([make_exp([5, 6, 7, 8], 2, 1.0, "a"), make_exp([5, 6, 9], 2, 0.0, "a")])
    state = engine.state_dict()
    assert state["model"] and all("lora_" in name for name in state["model"])
    engine.save_state(tmp_path)

    resumed = lora_engine(tiny_model_dir, lr=1e-2)
    resumed.load_state(tmp_path)
    assert resumed.step == 1
    for (name, a), (_, b) in zip(engine.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name
    other = lora_engine(tiny_model_dir, LoraSettings(rank=4, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="do not match model.lora"):
        other.load_state(tmp_path)


def test_grpo_with_lora_raises_a_synthetic_reward():
    """As the full fine-tuning test in test_training_engine, with rank-4 adapters on every projection.

    The adapters leave the tied embedding / output head and the final norm as they are, and those bound the
    logits: a freshly initialised model (embeddings of std 0.02) cannot move a token past p ~ 0.1 through its
    projections alone. The embeddings are scaled up to give the base model a trained model's logit range."""
    target, prompt = 5, [1, 2, 3]
    torch.manual_seed(0)
    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(6.0)
    engine = TrainingEngine(model, TrainingSettings(lr=5e-2, advantage="grpo", micro_batch_size=16),
                            device="cpu", lora=LoraSettings(rank=4, alpha=8.0))

    def p_target() -> float:
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        return float(torch.softmax(logits, -1)[target])

    before, rewards = p_target(), []
    for step in range(15):
        exps = []
        for g in range(4):
            resp, logp = sample(engine.model, prompt, n=8, length=2)
            for i in range(8):
                rewards.append(float(resp[i, 0] == target))
                exps.append(make_exp(prompt + resp[i].tolist(), len(prompt), rewards[-1], f"s{step}g{g}",
                                     logp[i].tolist()))
        engine.train_step(exps)
    after = p_target()
    assert before < 0.05 and after > 0.4, (before, after)  # measured: 0.006 -> 0.63
    assert sum(rewards[-64:]) > 4 * sum(rewards[:64]) + 8  # measured: 1 -> 38 of 64


# ----------------------------------------------------------------------------- inference side
def test_a_swapped_adapter_generates_as_the_merged_model(tiny_model_dir: Path, tmp_path: Path):
    trainer = lora_engine(tiny_model_dir)
    trained_adapter(trainer)
    _, signal = publish(trainer, tmp_path / "store", 1)
    follower, worker, _ = follower_for(tiny_model_dir, tmp_path / "store")
    before = greedy(worker)

    assert follower.swap_to_latest(View(signal)) and follower.take_refusals() == []
    after = greedy(worker)
    assert worker.version == 1
    assert after[0] != before[0] or max(abs(x - y) for x, y in zip(after[1], before[1])) > 0.1

    merged_dir = tmp_path / "peft-merged"
    copy.deepcopy(trainer.model).merge_and_unload().save_pretrained(merged_dir)  # peft's own merge
    (merged_dir / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            (merged_dir / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert_same_answer(greedy(create_engine("transformers", merged_dir, device="cpu")), after)

    exported = export_version((tmp_path / "store").as_uri(), 1, tiny_model_dir, tmp_path / "export", lora=LORA)
    assert_same_answer(greedy(create_engine("transformers", exported, device="cpu")), after)


def test_merge_is_base_plus_scaled_b_times_a(tiny_model_dir: Path):
    base = read_base_weights(tiny_model_dir, LORA)
    name = "model.layers.1.self_attn.v_proj"
    out_features, in_features = base[f"{name}.weight"].shape
    a, b = torch.randn(LORA.rank, in_features), torch.randn(out_features, LORA.rank)
    merger = AdapterMerger(LORA, base)
    merged = merger.merge({f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b})
    assert set(merged) == set(base)  # the whole model: vLLM loads complete weight sets only
    torch.testing.assert_close(merged[f"{name}.weight"], base[f"{name}.weight"] + (8.0 / 4) * b @ a)
    assert all(merged[n] is base[n] for n in base if n != f"{name}.weight")
    with pytest.raises(ValueError, match="not among"):  # k_proj is not a target of LORA
        merger.merged_shapes({"model.layers.0.self_attn.k_proj.lora_A.weight": (4, 64),
                              "model.layers.0.self_attn.k_proj.lora_B.weight": (32, 4)})


@pytest.mark.parametrize("published, worker, reason", [
    (LoraSettings(rank=8, alpha=8.0, target_modules=("q_proj", "v_proj")), LORA, "rank 8"),
    (None, LORA, "whole weights"),
    (LORA, None, "is a LoRA adapter"),
])
def test_an_adapter_the_worker_cannot_apply_is_refused_and_the_weights_stay(
        tiny_model_dir: Path, tmp_path: Path, published, worker, reason):
    trainer = (lora_engine(tiny_model_dir, published) if published else
               TrainingEngine.from_pretrained(tiny_model_dir, TrainingSettings(), device="cpu"))
    if published:
        trained_adapter(trainer)
    _, signal = publish(trainer, tmp_path / "store", 1)
    follower, engine, registry = follower_for(tiny_model_dir, tmp_path / "store", worker)
    served = {n: t.clone() for n, t in engine.state_dict().items()}

    assert not follower.swap_to_latest(View(signal))
    [refusal] = follower.take_refusals()
    assert refusal.reason == "incompatible-weights" and reason in refusal.detail
    assert registry.get_sample_value("streamrft_rollout_weights_refused_total",
                                     {"reason": "incompatible-weights"}) == 1
    assert engine.version == 0
    assert all(torch.equal(t, served[n]) for n, t in engine.state_dict().items())


def test_export_refuses_a_payload_the_config_does_not_describe(tiny_model_dir: Path, tmp_path: Path):
    trainer = lora_engine(tiny_model_dir)
    publish(trainer, tmp_path / "store", 1)
    with pytest.raises(ValueError, match="model.lora is not set"):
        export_version((tmp_path / "store").as_uri(), 1, tiny_model_dir, tmp_path / "out")
    with pytest.raises(ValueError, match="no complete v2"):
        export_version((tmp_path / "store").as_uri(), 2, tiny_model_dir, tmp_path / "out", lora=LORA)


def test_the_export_command_writes_a_model_the_transformers_engine_loads(tiny_model_dir: Path, tmp_path: Path,
                                                                         capsys):
    import yaml

    from streamrft.cli import main

    trainer = lora_engine(tiny_model_dir)
    trained_adapter(trainer, seed=1)
    publish(trainer, tmp_path / "store", 3)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"name": "t-export", "model": {"path": str(tiny_model_dir),
                                                                    "lora": LORA.model_dump(mode="json")},
                                      "trainer": {"weights": {"url": (tmp_path / "store").as_uri()}}}))
    assert main(["export", str(config), "--version", "3", str(tmp_path / "out")]) == 0
    assert "merged LoRA adapter" in capsys.readouterr().out
    expected = AdapterMerger(LORA, read_base_weights(tiny_model_dir, LORA)).merge(dict(trainer.named_weights()))
    exported = create_engine("transformers", tmp_path / "out", device="cpu").state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    assert main(["export", str(config), "--version", "4", str(tmp_path / "out4")]) == 2  # explained, not a trace
