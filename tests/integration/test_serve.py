"""Serve mode on the real broker with the tiny model, through the official `openai` client: completions
(streamed and not), feedback that becomes Experiences with the very tokens and logprobs the server returned, a
trainer that trains on them, and the server swapping to the weights it publishes."""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai
import pytest

from streamrft.consumers.serve.role import ServeRole
from streamrft.commands.serve import http_server
from streamrft.kafka import KafkaClients
from streamrft.lifecycle import StopSignal
from streamrft.schemas import Experience, unpack_f32, unpack_i32

from .roles import read_all
from .test_trainer_side import trainer_thread

pytestmark = [pytest.mark.kafka, pytest.mark.model]

KEY = "sk-streamrft-test"
QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def serve_config(run_config, tiny_model_dir, tmp_path, *, serve: dict | None = None, **sections):
    settings = {
        "model": {"path": str(tiny_model_dir)},
        "explorer": {"batch_size": 1, "repeat_times": 4, "metrics_port": None},
        "rollout": {"sampling": {"max_tokens": 6, "temperature": 1.0}, "metrics_port": None},
        "trainer": {"checkpoint_dir": str(tmp_path / "ckpt"), "metrics_port": None, "device": "cpu", "lr": 1e-2,
                    "micro_batch_size": 8, "total_steps": 1},
        "serve": {"api_key": KEY, "port": 0, "model_name": "tiny", "sync_poll_s": 0.2, **(serve or {})}}
    for section, values in sections.items():
        settings[section] = {**settings[section], **values}
    return run_config(**settings)


@contextlib.contextmanager
def serving(config, engine=None):
    """`streamrft serve`'s role and HTTP server in this process (on ``engine``, default the run's); yields
    (clients, role, base url, openai client)."""
    clients = KafkaClients(config, config.kafka.bootstrap_servers)
    clients.ensure_topics()
    role = ServeRole(config, clients, StopSignal(signals=()), engine=engine).start()
    server = http_server(role)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the HTTP server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    try:
        yield clients, role, base, openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    finally:
        server.should_exit = True
        thread.join(10)
        role.close()
        clients.close()


@pytest.fixture
def served(run_config, tiny_model_dir, tmp_path):
    config = serve_config(run_config, tiny_model_dir, tmp_path)
    with serving(config) as (clients, role, base, client):
        yield config, clients, role, base, client


def feedback(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/feedback", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def test_the_openai_client_gets_completions_streamed_and_not(served):
    config, _, role, base, client = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=QUESTION, n=2, max_tokens=5, logprobs=True)
    assert chat.id.startswith("chatcmpl-") and len(chat.choices) == 2
    assert chat.system_fingerprint == "v0" and chat.usage.completion_tokens >= 2
    for choice in chat.choices:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
        assert 1 <= len(choice.logprobs.content) <= 5
        assert all(t.logprob <= 0 for t in choice.logprobs.content)
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, stream=True, seed=3)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, seed=3)
    assert streamed == again.choices[0].message.content  # same seed: what streamed is the whole answer
    text = client.completions.create(model="tiny", prompt="3 + 4 =", max_tokens=4, logprobs=1)
    assert text.object == "text_completion" and len(text.choices[0].logprobs.token_logprobs) >= 1
    pieces = list(client.completions.create(model="tiny", prompt="3 + 4 =", max_tokens=4, stream=True))
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="another", messages=QUESTION)
    assert httpx.get(f"{base}/health").json()["model_version"] == 0
    metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'streamrft_serve_requests_total{endpoint="chat"} 3.0' in metrics
    assert len(role.pending) == 2 + 1 + 1 + 1 + 1  # every choice above waits for feedback


def test_feedback_becomes_experiences_a_trainer_learns_from_and_the_server_swaps(served):
    config, clients, role, base, client = served
    chat = client.chat.completions.create(model="tiny", messages=QUESTION, n=4, max_tokens=6, logprobs=True)
    rewards = [1.0, 0.0, 1.0, 0.0]
    for i, reward in enumerate(rewards):
        answer = feedback(base, response_id=chat.id, choice=i, reward=reward)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"eid": f"{chat.id}/{i}", "group_id": chat.id, "group_size": 4, "run_index": i,
                                 "model_version": 0}
    again = feedback(base, response_id=chat.id, choice=0, reward=1.0)  # a retry: the same answer, nothing written
    assert again.status_code == 200 and again.json()["eid"] == f"{chat.id}/0", again.text
    assert feedback(base, response_id=chat.id, choice=0, reward=0.5).status_code == 409  # another reward: refused
    assert feedback(base, response_id="chatcmpl-unknown", reward=1.0).status_code == 404
    experiences = sorted(read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1),
                         key=lambda e: e.run_index)
    assert [e.reward for e in experiences] == rewards
    for experience, choice in zip(experiences, chat.choices):
        assert experience.group_id == chat.id and experience.group_size == 4
        served_logprobs = [t.logprob for t in choice.logprobs.content]
        assert unpack_f32(experience.logprobs).tolist() == pytest.approx(served_logprobs, abs=1e-6)
        response = unpack_i32(experience.tokens)[experience.prompt_length:]
        assert role.engine.tokenizer.decode(response, skip_special_tokens=True) == choice.message.content
    trainer = trainer_thread(config, clients)
    trainer.join(120)
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/health").json()["model_version"] != 1:
        assert time.monotonic() < deadline, "the server never swapped to the trained weights"
        time.sleep(0.2)
    after = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
    assert after.system_fingerprint == "v1"


def test_rollout_engine_openai_rolls_out_through_the_served_endpoint(served, run_config, tiny_model_dir):
    """rollout.engine: openai against streamrft's own server: the same samples (same seed) and logprobs as the
    server gives the openai client, and a rollout worker turns a request into a result and experiences."""
    import json

    from streamrft.consumers.rollout import RolloutWorker, build_engine
    from streamrft.engines.inference import SamplingParams
    from streamrft.schemas import RolloutKind, RolloutRequest, RolloutResult, RolloutStatus, Task

    _, _, _, base, client = served
    remote = run_config(model={"path": str(tiny_model_dir)},
                        rollout={"engine": "openai", "metrics_port": None, "sampling": {"max_tokens": 5, "seed": 11},
                                 "openai": {"base_url": f"{base}/v1", "model": "tiny", "api_key": KEY}})
    engine = build_engine(remote)
    try:
        chat, tokens = engine.generate([QUESTION, [5, 9, 11]], SamplingParams(temperature=1.0, max_tokens=5, seed=3),
                                       n=2)
        direct = client.chat.completions.create(model="tiny", messages=QUESTION, n=2, max_tokens=5, seed=3,
                                                logprobs=True)
        for mine, theirs in zip(chat, direct.choices):
            assert mine.text == theirs.message.content
            assert mine.logprobs == pytest.approx([t.logprob for t in theirs.logprobs.content], abs=1e-6)
            assert "engine/logprobs_missing" not in mine.metrics  # one tokenizer on both sides
            assert mine.prompt_ids == engine.prompt_ids(QUESTION)
        assert all(c.prompt_ids == [5, 9, 11] and len(c.logprobs) == len(c.response_ids) for c in tokens)
        with pytest.raises(ValueError, match="takes no weights"):
            engine.check_weights({"lm_head.weight": (1, 1)})
    finally:
        engine.close()

    clients = KafkaClients(remote, remote.kafka.bootstrap_servers)
    clients.ensure_topics()
    producer = clients.producer()
    task = Task(task_id="t0", workflow="arithmetic", payload=json.dumps({"question": "3 + 4", "answer": "7"}))
    producer.produce(remote.topic("rollouts"), RolloutRequest(request_id="r0", step=0, kind=RolloutKind.TRAIN,
                                                              task=task, repeat_times=2))
    producer.flush()
    worker = RolloutWorker(remote, clients, StopSignal(signals=()), "via-openai")
    try:
        assert worker.run(max_requests=1) == 1
    finally:
        worker.close()
    (result,) = read_all(remote, clients.bootstrap, "results", clients.serde, RolloutResult, idle=1)
    assert result.status == RolloutStatus.OK and result.n == 2
    experiences = read_all(remote, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
    assert sorted(e.eid for e in experiences) == ["r0/0", "r0/1"]
    clients.close()


def test_conversation_grouping_writes_a_conversations_rewarded_turns_as_one_group(run_config, tiny_model_dir,
                                                                                  tmp_path):
    """serve.grouping conversation: three turns of one conversation (named in the request body through the
    openai client's extra_body) are held until the feedback that ends it, then written as one group of 3; a
    turn of another conversation stays held; a response without a conversation is refused and can be rewarded
    again later."""
    config = serve_config(run_config, tiny_model_dir, tmp_path, serve={"grouping": "conversation"})
    with serving(config) as (clients, role, base, client):
        history = list(QUESTION)
        turns = []
        for _ in range(3):
            answer = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                                    extra_body={"conversation_id": "conv-7"})
            turns.append(answer)
            history += [{"role": "assistant", "content": answer.choices[0].message.content},
                        {"role": "user", "content": "And plus 1?"}]
        elsewhere = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4,
                                                   extra_body={"conversation_id": "conv-8"})
        unnamed = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
        refused = feedback(base, response_id=unnamed.id, reward=1.0)
        assert refused.status_code == 400 and "conversation_id" in refused.text
        held = [feedback(base, response_id=turns[0].id, reward=0.0), feedback(base, response_id=elsewhere.id,
                reward=1.0), feedback(base, response_id=turns[1].id, reward=0.5)]
        assert [(r.status_code, r.json()["written"], r.json()["held"]) for r in held] == [  # 202: held, not written
            (202, [], 1), (202, [], 1), (202, [], 2)]
        assert read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=0.5) == []
        ended = feedback(base, response_id=turns[2].id, reward=1.0, end_conversation=True).json()
        assert ended == {"written": [f"{t.id}/0" for t in turns], "group_size": 3}
        experiences = read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
        assert [(e.eid, e.reward, e.run_index, e.group_size) for e in experiences] == [
            (f"{turns[0].id}/0", 0.0, 0, 3), (f"{turns[1].id}/0", 0.5, 1, 3), (f"{turns[2].id}/0", 1.0, 2, 3)]
        assert len({e.group_id for e in experiences}) == 1 and "conv-7" in experiences[0].group_id
        assert len(role.feedback_desk.conversations) == 1  # conv-8's turn, still open
        assert feedback(base, response_id=turns[0].id, reward=1.0).status_code == 409  # never twice


def test_online_feedback_raises_the_reward_of_the_served_answers(run_config, tiny_model_dir, tmp_path):
    """Online learning through serve mode alone: an application asks for 16 answers, rewards those that start
    with a digit (~10 % for the random tiny model), and waits for the trainer's next version; 20 rounds of
    that raise the reward of what the server answers (seeded samples, so a failure reproduces)."""
    rounds, n = 20, 16
    config = serve_config(run_config, tiny_model_dir, tmp_path,
                          explorer={"repeat_times": n},
                          trainer={"total_steps": rounds, "save_interval": 1000, "micro_batch_size": 16,
                                   "algorithm": {"clip_high": 0.28}})
    with serving(config) as (clients, role, base, client):
        trainer = trainer_thread(config, clients)
        rewards = []
        for version in range(rounds):
            answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content":
                                                                             "Say a number."}], n=n, max_tokens=3,
                                                    seed=version)
            assert answer.system_fingerprint == f"v{version}"  # on-policy: each round on the newest weights
            scores = [1.0 if c.message.content[:1].isdigit() else 0.0 for c in answer.choices]
            rewards.append(sum(scores) / n)
            for i, score in enumerate(scores):
                assert feedback(base, response_id=answer.id, choice=i, reward=score).status_code == 200
            deadline = time.monotonic() + 60
            while version + 1 < rounds and httpx.get(f"{base}/health").json()["model_version"] != version + 1:
                assert time.monotonic() < deadline and trainer.error is None, f"no v{version + 1}"
                time.sleep(0.1)
        trainer.join(60)
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"\nserved reward first 4 rounds {first:.3f} -> last 4 rounds {last:.3f}: {rewards}")
    assert last > first + 0.3, rewards
