"""Serve mode under concurrent load, on the real broker with the tiny model, through the `openai` client: many
requests share one engine batch and stream token by token, a client that disconnects leaves the engine, a full
server answers 429 and recovers, and a weight swap under load fails nothing while each choice names the version
that generated it."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from streamrft.engines.weights.object_store import ObjectStore
from streamrft.schemas import Experience, SyncKind, SyncMethod, SyncSignal, unpack_f32, unpack_i32

from .roles import read_all
from .test_serve import KEY, serve_config, serving

pytestmark = [pytest.mark.kafka, pytest.mark.model]


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {i} + {i + 3}?"}]


def together(count: int, call) -> list:
    """``call(i)`` on ``count`` threads released at once; their results (or exceptions) in order."""
    barrier, results = threading.Barrier(count), [None] * count

    def run(i):
        barrier.wait()
        try:
            results[i] = call(i)
        except Exception as exc:  # noqa: BLE001 - the test looks at what each got
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def streamed_text(client: openai.OpenAI, i: int, max_tokens: int) -> tuple[str, int, float, float, str]:
    """(text, content chunks, first content chunk time, last chunk time, fingerprint) of a streamed answer."""
    text, chunks, first, last, fingerprint = "", 0, None, None, ""
    stream = client.chat.completions.create(model="tiny", messages=question(i), max_tokens=max_tokens, seed=i,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        last = time.monotonic()
        fingerprint = chunk.system_fingerprint or fingerprint
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                chunks += 1
                first = first or last
    return text, chunks, first, last, fingerprint


def test_sixteen_concurrent_requests_share_one_batch_and_stream_token_by_token(run_config, tiny_model_dir,
                                                                               tmp_path):
    config = serve_config(run_config, tiny_model_dir, tmp_path, serve={"batch_window_ms": 500})
    with serving(config) as (_, _, base, client):
        def call(i):
            if i % 2:
                return streamed_text(client, i, max_tokens=16)
            return client.chat.completions.create(model="tiny", messages=question(i), max_tokens=16, seed=i)

        results = together(16, call)
        assert not [r for r in results if isinstance(r, Exception)], results
        assert metric(base, "streamrft_serve_batch_size_max") >= 16  # the engine ran them in one batch
        for i, result in enumerate(results):
            alone = client.chat.completions.create(model="tiny", messages=question(i), max_tokens=16, seed=i)
            if i % 2:
                text, chunks, first, last, _ = result
                assert text == alone.choices[0].message.content, i  # its own prompt's answer, whatever the batch
                assert chunks >= 2 and first < last  # tokens came as they were produced, before the end
            else:
                assert result.choices[0].message.content == alone.choices[0].message.content, i
        assert metric(base, "streamrft_serve_running") == 0


def test_a_client_that_disconnects_mid_stream_leaves_the_engine(run_config, tiny_model_dir, tmp_path):
    config = serve_config(run_config, tiny_model_dir, tmp_path)
    with serving(config) as (_, _, base, client):
        other = {}
        worker = threading.Thread(target=lambda: other.setdefault("answer", client.chat.completions.create(
            model="tiny", messages=question(1), max_tokens=40, seed=1)))
        body = {"model": "tiny", "messages": question(2), "max_tokens": 500, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            worker.start()
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(4)) if line.startswith("data:")]
            assert received  # it streams ...
        # ... and the client hangs up long before 500 tokens
        deadline = time.monotonic() + 30
        while metric(base, "streamrft_serve_cancelled") < 1 or metric(base, "streamrft_serve_running") > 0:
            assert time.monotonic() < deadline, "the disconnected request stayed in the engine"
            time.sleep(0.1)
        worker.join(60)
        assert other["answer"].choices[0].message.content is not None  # the other request was not disturbed
        assert metric(base, "streamrft_serve_cancelled") == 1


def test_over_capacity_the_server_answers_429_with_retry_after_and_recovers(run_config, tiny_model_dir, tmp_path):
    config = serve_config(run_config, tiny_model_dir, tmp_path, serve={"max_running": 1, "max_waiting": 1})
    with serving(config) as (_, _, base, client):
        results = together(8, lambda i: client.chat.completions.create(model="tiny", messages=question(i),
                                                                        max_tokens=64))
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        answered = [r for r in results if not isinstance(r, Exception)]
        assert len(refused) + len(answered) == 8, [r for r in results if isinstance(r, Exception)]
        assert refused and len(answered) >= 2  # one running, one waiting, the rest refused at once
        assert all(int(r.response.headers["Retry-After"]) >= 1 for r in refused)
        assert metric(base, "streamrft_serve_refused") == len(refused)
        assert client.chat.completions.create(model="tiny", messages=question(9), max_tokens=8).choices  # recovered


def teacher_forced_logprobs(model, tokens: list[int], prompt_length: int, temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float() / temperature
    chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return chosen[prompt_length - 1:].tolist()


def test_a_weight_swap_under_load_fails_nothing_and_each_choice_names_its_version(run_config, tiny_model_dir,
                                                                                  tmp_path):
    from transformers import AutoModelForCausalLM

    config = serve_config(run_config, tiny_model_dir, tmp_path)
    with serving(config) as (clients, role, base, client):
        v0 = {name: tensor.clone() for name, tensor in role.engine.state_dict().items()}
        v1 = {name: tensor + 0.02 * torch.randn_like(tensor) for name, tensor in v0.items()}
        published = ObjectStore(config.weights_url).publish(v1.items(), version=1)

        def publish_meanwhile():
            time.sleep(0.3)
            producer = clients.producer()
            producer.produce(config.topic("sync"), SyncSignal(
                kind=SyncKind.WEIGHTS_PUBLISHED, version=1, method=SyncMethod.OBJECT_STORE,
                uri=published.uri, sha256=published.sha256, nbytes=published.nbytes))
            producer.flush()

        threading.Thread(target=publish_meanwhile).start()

        def ask(i):
            time.sleep(0.15 * i)  # requests keep coming while the swap is due
            return client.chat.completions.create(model="tiny", messages=question(i), max_tokens=12, logprobs=True)

        results = together(12, ask)
        assert not [r for r in results if isinstance(r, Exception)], results
        assert {r.system_fingerprint for r in results} == {"v0", "v1"}
        assert metric(base, "streamrft_serve_weight_swaps") == 1

        models = {}
        for version, weights in (("v0", v0), ("v1", v1)):
            models[version] = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
            models[version].load_state_dict(weights)
        for result in results:  # every choice's feedback: its experience holds the token ids it was served
            feedback = httpx.post(f"{base}/feedback", json={"response_id": result.id, "reward": 1.0},
                                  headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            assert feedback.json()["model_version"] == int(result.system_fingerprint[1:])
        experiences = {e.group_id: e for e in read_all(config, clients.bootstrap, "experiences", clients.serde,
                                                        Experience, idle=1)}
        assert set(experiences) == {r.id for r in results}
        for i, result in enumerate(results):
            experience = experiences[result.id]
            tokens = unpack_i32(experience.tokens).tolist()
            served = [t.logprob for t in result.choices[0].logprobs.content]
            assert unpack_f32(experience.logprobs).tolist() == pytest.approx(served, abs=1e-6), i
            assert f"v{experience.model_version}" == result.system_fingerprint, i
            mine = teacher_forced_logprobs(models[result.system_fingerprint], tokens, experience.prompt_length, 1.0)
            other = "v1" if result.system_fingerprint == "v0" else "v0"
            theirs = teacher_forced_logprobs(models[other], tokens, experience.prompt_length, 1.0)
            assert mine == pytest.approx(served, abs=1e-4), i  # generated by the version it names ...
            assert theirs != pytest.approx(served, abs=1e-4), i  # ... and not by the other
