"""Serve mode as the OpenAI API's clients expect it, through the official `openai` client (and raw HTTP where the
client hides the wire): errors in OpenAI's shape for every status, with the connection kept; a batch of prompts,
echo and prompt logprobs with alternatives (what lm-eval's loglikelihood reads), checked against the engine's own
numbers; chat content parts, an agent loop's history, tool calls, alternatives, and guided decoding refused with
its reason on the transformers engine. What is served still becomes experiences: a batch's choices are grouped
per prompt. One server (the real broker, the tiny model) for the module; another with a scripted engine for tool
calls."""
from __future__ import annotations

import http.client
import json
import uuid

import httpx
import openai
import pytest
import torch

from streamrft.config import load_config
from streamrft.engines.inference.fake import FakeEngine
from streamrft.schemas import Experience

from .roles import read_all
from .test_serve import KEY, QUESTION, serve_config, serving

pytestmark = [pytest.mark.kafka, pytest.mark.model]

AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def _config(kafka_bootstrap, tiny_model_dir, tmp):
    def make(**overrides):
        base = {"name": f"t{uuid.uuid4().hex[:10]}", "kafka": {"bootstrap_servers": kafka_bootstrap}}
        return load_config(overrides={**base, **overrides}, env={})

    return serve_config(make, tiny_model_dir, tmp)


@pytest.fixture(scope="module")
def served(kafka_bootstrap, tiny_model_dir, tmp_path_factory):
    config = _config(kafka_bootstrap, tiny_model_dir, tmp_path_factory.mktemp("serve-openai"))
    with serving(config) as (clients, role, base, client):
        yield config, clients, role, base, client


def experiences_of(config, clients, response_id: str) -> list[Experience]:
    return [e for e in read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
            if e.eid.startswith(f"{response_id}/")]


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ({"seed": 2 ** 63}, "seed", "9223372036854775807"),
    ({"logprobs": 6}, "logprobs", "[0, 5]"),
    ({"suffix": " end"}, "suffix", "does not support"),
    ({"best_of": 2}, "best_of", "does not support"),
    ({"logit_bias": {"5": 50}}, "logit_bias", "distribution"),
    ({"prompt": [999999]}, "prompt[0]", "vocabulary"),
    ({"prompt": [[5, 6], [7, 999999]]}, "prompt[1][1]", "vocabulary"),
])
def test_text_completion_refusals_are_400_naming_the_field(served, body, param, words):
    client = served[4]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{"model": "tiny", "prompt": "3 + 4 =", "max_tokens": 1, **body})
    assert refused.value.status_code == 400 and refused.value.param == param, refused.value.body
    assert words in refused.value.message and refused.value.type == "invalid_request_error"


@pytest.mark.parametrize("body, param, words", [
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs", "[0, 20]"),
    ({"temperature": -0.5}, "temperature", "[0, 2]"),
    ({"response_format": {"type": "json_object"}}, "response_format", "guided decoding"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
     "response_format", "vllm"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "guided decoding"),
    ({"functions": [WEATHER["function"]]}, "functions", "does not support"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://a/b.png"}}]}]},
     "messages[0].content[0].type", "'image_url'"),
])
def test_chat_refusals_are_400_naming_the_field(served, body, param, words):
    client = served[4]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{"model": "tiny", "messages": QUESTION, "max_tokens": 1, **body})
    assert refused.value.param == param and words in refused.value.message, refused.value.body


def test_errors_are_openais_shape_for_every_status_and_keep_the_connection(served):
    _, _, role, base, client = served
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"
    port = int(base.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    sent = [("POST", "/v1/completions", {"model": "tiny", "prompt": [999999], "max_tokens": 1}, 400),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 3}, 400),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "echo": True, "stream": True}, 400),
            ("GET", "/v1/nowhere", None, 404), ("DELETE", "/v1/models", None, 405),
            ("POST", "/feedback", {"response_id": "cmpl-x", "reward": 1.0}, 404),
            ("POST", "/feedback", {"response_id": "cmpl-x", "reward": 1.0, "rewrd": 2}, 400),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 1}, 200)]
    for method, path, body, status in sent:  # one kept-alive connection: an error does not close it
        connection.request(method, path, body=json.dumps(body) if body else None,
                           headers={**AUTH, "Content-Type": "application/json"})
        answer = connection.getresponse()
        payload = json.loads(answer.read())
        assert answer.status == status, (path, payload)
        assert answer.getheader("connection") != "close"
        if status != 200:
            assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    connection.close()
    unauthorized = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"


def test_a_batch_of_prompts_answers_prompt_major_and_each_prompts_choices_are_a_group(served):
    config, clients, role, base, client = served
    for prompt in (["3 + 4 =", "12 - 5 ="], [role.engine.encode("3 + 4 ="), role.engine.encode("12 - 5 =")]):
        batch = client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=3, seed=5, temperature=1.0)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        for k, text in enumerate(["3 + 4 =", "12 - 5 ="]):
            alone = client.completions.create(model="tiny", prompt=text, n=2, max_tokens=3, seed=5, temperature=1.0)
            assert [c.text for c in batch.choices[2 * k: 2 * k + 2]] == [c.text for c in alone.choices]
    for i in range(4):
        assert httpx.post(f"{base}/feedback", json={"response_id": batch.id, "choice": i, "reward": float(i)},
                          headers=AUTH, timeout=30).status_code == 200
    written = sorted(experiences_of(config, clients, batch.id), key=lambda e: e.eid)
    assert [(e.group_id, e.group_size, e.run_index, e.reward) for e in written] == [
        (f"{batch.id}.p0", 2, 0, 0.0), (f"{batch.id}.p0", 2, 1, 1.0),
        (f"{batch.id}.p1", 2, 0, 2.0), (f"{batch.id}.p1", 2, 1, 3.0)]


def test_echo_gives_the_prompts_logprobs_of_the_model_as_lm_eval_reads_them(served):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1, temperature 0; the prompt's
    logprobs are the model's (a teacher-forced forward here) and each position lists the most likely token."""
    role, client = served[2], served[4]
    context, continuation = role.engine.encode("3 + 4 ="), role.engine.encode(" 7")
    ids = context + continuation
    answer = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, logprobs=1, echo=True,
                                       temperature=0, seed=1234)
    (choice,) = answer.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and choice.text.startswith("3 + 4 = 7")
    with torch.no_grad():
        expected = torch.log_softmax(role.engine.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    own = expected.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(own, abs=1e-4)
    for i in range(1, len(ids)):
        top = logprobs.top_logprobs[i]
        assert max(top.values()) == pytest.approx(expected[i - 1].max().item(), abs=1e-4)
        assert logprobs.token_logprobs[i] in top.values()
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    plain = client.completions.create(model="tiny", prompt="3 + 4 =", max_tokens=3, logprobs=2, seed=3)
    assert all(len(top) >= 2 for top in plain.choices[0].logprobs.top_logprobs)


def test_chat_takes_parts_an_agent_history_and_gives_alternatives(served):
    client = served[4]
    history = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
               {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4,
                                            logprobs=True, top_logprobs=3, seed=2)
    (choice,) = answer.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for token in choice.logprobs.content:
        values = [t.logprob for t in token.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and token.logprob <= values[0] + 1e-6
    streamed = list(client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4,
                                                   seed=2, stream=True))
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason


def test_an_answer_that_calls_a_tool_comes_back_as_tool_calls(kafka_bootstrap, tiny_model_dir, tmp_path):
    """A scripted engine answers with a call in the project's format: the client gets OpenAI's tool_calls, whole
    or streamed, and the served tokens still wait for feedback as an experience."""
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine = FakeEngine(tiny_model_dir, responder=lambda prompt, i: call if "weather" in prompt else "7")
    config = _config(kafka_bootstrap, tiny_model_dir, tmp_path)
    with serving(config, engine) as (clients, role, base, client):
        answer = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], max_tokens=120)
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "weather" and json.loads(tool_call.function.arguments) == {"city": "Oslo"}
        chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER],
                                                     max_tokens=120, stream=True))
        (streamed,) = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert streamed[0].function.name == "weather"
        plain = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                               max_tokens=120)
        assert plain.choices[0].message.content == call and plain.choices[0].finish_reason == "stop"
        assert httpx.post(f"{base}/feedback", json={"response_id": answer.id, "reward": 1.0}, headers=AUTH,
                          timeout=30).status_code == 200
        (experience,) = experiences_of(config, clients, answer.id)
        assert experience.reward == 1.0
