"""Serve mode's OpenAI dialect without a server: chat prompts with tools and tool calls through a template that
knows them and one that does not, reading an answer's tool calls, what a request may ask of an engine, the
shape of echoed logprobs, and the transformers engine's alternatives and prompt logprobs against a teacher-forced
forward pass."""
from __future__ import annotations

import json

import pytest
import torch
from fastapi import HTTPException

from streamrft.consumers.serve.api_models import ChatRequest, CompletionRequest
from streamrft.consumers.serve.chat_prompt import ChatPrompts, ToolAnswer
from streamrft.consumers.serve.openai_format import ChatFormat, TextFormat
from streamrft.consumers.serve.request_options import sampling_options
from streamrft.engines.inference import Completion, SamplingParams, create_engine
from streamrft.engines.inference.fake import FakeEngine

WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
HISTORY = [{"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
# a template that shows tools and renders tool calls itself (Hermes-like)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}:{{ c.function.arguments | tojson }}</call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat(**body) -> ChatRequest:
    return ChatRequest.model_validate({"messages": HISTORY, **body})


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def rendered(engine: FakeEngine, request: ChatRequest) -> str:
    return engine.decode(ChatPrompts(engine).prompt_ids(request), skip_special_tokens=False)


def test_a_template_without_tools_gets_the_projects_tool_call_format(engine):
    text = rendered(engine, chat(tools=[WEATHER]))
    system, user = text.split("<|im_start|>user\n")
    assert system.startswith("<|im_start|>system\n") and "<tool_call>" in system and '"name": "weather"' in system
    assert user.startswith("Weather in Oslo?<|im_end|>")  # the text parts, joined
    assert '<|im_start|>assistant\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool\nrain<|im_end|>" in text
    assert "<tool_call>" not in rendered(engine, chat()).split("<|im_start|>user")[0]  # no tools: no listing


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_they_are(engine):
    engine.tokenizer.chat_template = TOOL_TEMPLATE
    text = rendered(engine, chat(tools=[WEATHER]))
    assert text.startswith("<|im_start|>system\nTOOLS:weather;")
    assert '<call>weather:{"city": "Oslo"}</call>' in text and "<tool_call>" not in text


def test_parts_of_another_type_and_null_content_are_refused_naming_the_field(engine):
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    with pytest.raises(HTTPException) as refused:
        ChatPrompts(engine).prompt_ids(ChatRequest.model_validate({"messages": [image]}))
    assert refused.value.status_code == 400 and refused.value.detail["param"] == "messages[0].content[0].type"
    assert "'image_url'" in refused.value.detail["message"]
    with pytest.raises(HTTPException) as refused:
        ChatPrompts(engine).prompt_ids(ChatRequest.model_validate({"messages": [{"role": "user", "content": None}]}))
    assert refused.value.detail["param"] == "messages[0].content"


def test_an_answers_calls_to_the_requests_tools_become_tool_calls():
    answer = ToolAnswer(chat(tools=[WEATHER]))
    calls = answer.calls('Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
                         '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>')
    assert calls.content == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in calls.tool_calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls.tool_calls)
    assert answer.calls('{"name": "weather", "arguments": {}}').content is None  # a bare call counts
    assert answer.calls('<tool_call>{"name": "stocks", "arguments": {}}</tool_call>') is None  # not a tool of it
    assert answer.calls("It rains.") is None
    assert ToolAnswer(chat(tools=[WEATHER], tool_choice="none")).calls('{"name": "weather"}') is None
    message = ChatFormat(chat(tools=[WEATHER]), FakeEngine().decode, answer).choice(
        0, Completion([1], [5], [-0.5], '<tool_call>{"name": "weather", "arguments": {}}</tool_call>', "stop", 0),
        ["x"])
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None


@pytest.mark.parametrize("body, param", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": -1.0}, "presence_penalty"),
    ({"logit_bias": {"5": 10.0}}, "logit_bias"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2, "stream": True}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "stocks"}}},
     "tool_choice.function.name"),
])
def test_what_the_engine_cannot_do_is_refused_with_the_reason(engine, body, param):
    request = chat(**body)
    with pytest.raises(HTTPException) as refused:
        sampling_options(request, engine, ToolAnswer(request))
    assert refused.value.status_code == 400 and refused.value.detail["param"] == param, refused.value.detail
    if "response_format" in body or body.get("tool_choice") == "required":
        assert "guided decoding" in refused.value.detail["message"]


def test_what_an_engine_with_guided_decoding_is_asked(engine):
    engine.structured_outputs = True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                   logprobs=True, top_logprobs=3, frequency_penalty=0.0, logit_bias={})
    assert sampling_options(request, engine, ToolAnswer(request)) == {"top_logprobs": 3,
                                                                       "json_schema": json.dumps(schema)}
    request = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}})
    required = json.loads(sampling_options(request, engine, ToolAnswer(request))["json_schema"])
    assert required["properties"]["name"] == {"const": "weather"}
    text = CompletionRequest.model_validate({"prompt": [[1, 2]], "echo": True, "logprobs": 2})
    assert sampling_options(text, engine) == {"top_logprobs": 2, "prompt_logprobs": 2}
    with pytest.raises(HTTPException):
        sampling_options(CompletionRequest.model_validate({"prompt": "a", "echo": True, "stream": True}), engine)


def test_an_echoed_prompt_comes_with_its_logprobs_first_none(engine):
    request = CompletionRequest.model_validate({"prompt": ["ab", "cd"], "echo": True, "logprobs": 1, "n": 2})
    prompt = engine.encode("cd")
    completion = Completion(prompt, [engine.encode("e")[0]], [-0.25], "e", "length", 0,
                            top_logprobs=[{engine.encode("e")[0]: -0.25, engine.encode("f")[0]: -2.0}],
                            prompt_logprobs=[None, {prompt[1]: -1.5, 7: -0.5}])
    choice = TextFormat(request, engine.decode, ["ab", "cd"]).choice(3, completion, ["e"])
    assert choice["text"] == "cde"  # choice 3 = prompt 1's second choice: its prompt echoed
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["c", "d", "e"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.25]
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][2] == {"e": -0.25, "f": -2.0}
    assert list(logprobs["top_logprobs"][1].values()) == [-0.5, -1.5]  # most likely first


@pytest.mark.model
def test_the_transformers_engine_gives_alternatives_and_prompt_logprobs_of_its_policy(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    engine = create_engine("transformers", tiny_model_dir, device="cpu")
    prompt = engine.encode("3 + 4 = 7")
    (completion,) = engine.generate([prompt], SamplingParams(temperature=0.7, max_tokens=4, seed=1, top_logprobs=3,
                                                             prompt_logprobs=2))[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = completion.prompt_ids + completion.response_ids
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float() / 0.7, -1)
    assert completion.prompt_logprobs[0] is None and len(completion.prompt_logprobs) == len(prompt)
    for i, step in enumerate(completion.prompt_logprobs[1:], start=1):
        best = expected[i - 1].topk(2)
        assert step[prompt[i]] == pytest.approx(expected[i - 1, prompt[i]].item(), abs=1e-4)
        assert set(step) == {prompt[i], *best.indices.tolist()}
    for k, (token, top) in enumerate(zip(completion.response_ids, completion.top_logprobs)):
        row = expected[len(prompt) - 1 + k]
        assert top[token] == pytest.approx(completion.logprobs[k], abs=1e-6)
        assert set(top) == {token, *row.topk(3).indices.tolist()}
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)
    plain = engine.generate([prompt], SamplingParams(temperature=0.7, max_tokens=4, seed=1))[0][0]
    assert plain.top_logprobs is None and plain.prompt_logprobs is None
    assert plain.response_ids == completion.response_ids  # asking for alternatives changes nothing sampled
    with pytest.raises(Exception, match="guided decoding"):
        engine.generate([prompt], SamplingParams(max_tokens=2, json_schema="{}"))
    engine.close()
