"""What an OpenAI client gets from a server, request by request: a report, not a test (exit code 0 always).

    python scripts/check_openai_api.py --base-url http://127.0.0.1:8000/v1 --model NAME [--api-key K] [--json OUT]

Each check sends one request that OpenAI's API answers in a known way (with the real ``openai`` client, and with
httpx where the client hides the wire: the raw error body, the kept-alive connection) and prints one row: the
request, what came back (HTTP status or the client's exception), and a verdict:

- PASS: what OpenAI's API does. Where the engine cannot do what was asked (``response_format`` without guided
  decoding, ``logit_bias`` on a server that samples the model's own distribution), a 400 naming the parameter and
  why is OpenAI's contract too: a clear refusal, never a silent plain answer.
- ANSWERED-DIFFERENTLY: a deliberate, clear answer that is not OpenAI's (a 400 for something OpenAI does).
- FAIL: a silent plain answer, FastAPI's 422, a 500, another error shape, a dropped connection.

The judging functions (``judge_*``, ``*_problem``) are pure and unit-tested; the ``check_*`` functions send.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import openai

PASS, FAIL, DIFFERENT = "PASS", "FAIL", "ANSWERED-DIFFERENTLY"
ERROR_KEYS = {"message", "type", "param", "code"}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                 "additionalProperties": False}


@dataclass(frozen=True)
class Outcome:
    """What came back: the HTTP status (None when no answer), the raw JSON body, the client's exception name."""
    status: int | None
    body: Any = None
    exception: str | None = None

    @property
    def got(self) -> str:
        status = "no answer" if self.status is None else str(self.status)
        return f"{status} {self.exception}" if self.exception else status


@dataclass(frozen=True)
class Row:
    check: str
    request: str
    expects: str
    got: str
    verdict: str
    why: str


# --- judging (pure) -------------------------------------------------------------------------------------------

def error_body_problem(body: Any) -> str | None:
    """None when ``body`` is OpenAI's error shape ``{"error": {message, type, param, code}}``, else what is off."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        keys = sorted(body) if isinstance(body, dict) else type(body).__name__
        return f"body is not {{'error': {{...}}}} (has {keys})"
    missing = ERROR_KEYS - set(body["error"])
    if missing:
        return f"error object lacks {sorted(missing)}"
    if not isinstance(body["error"]["message"], str) or not body["error"]["message"]:
        return "error.message is not a non-empty string"
    return None


def judge_refusal(outcome: Outcome, param: str) -> tuple[str, str]:
    """OpenAI answers an invalid or unsupported parameter with 400 in its error shape, naming the parameter."""
    if outcome.status is None:
        return FAIL, f"no HTTP answer ({outcome.exception})"
    if outcome.status == 200:
        return FAIL, "accepted silently (200)"
    if outcome.status != 400:
        detail = "FastAPI's validation status; OpenAI answers 400" if outcome.status == 422 else "OpenAI answers 400"
        return FAIL, f"{outcome.status}: {detail}"
    problem = error_body_problem(outcome.body)
    if problem:
        return FAIL, f"400 but {problem}"
    error = outcome.body["error"]
    named = error.get("param") or ""
    if named == param or named.startswith(f"{param}[") or named.startswith(f"{param}."):
        return PASS, f"400 param={named}: {_short(error['message'])}"
    return DIFFERENT, f"400 but param={named!r}, not {param!r}: {_short(error['message'])}"


def judge_unsupported_or(outcome: Outcome, param: str, honoured: Callable[[Any], str | None]) -> tuple[str, str]:
    """A parameter the engine may not support: honoured (``honoured(body)`` returns None) or a clear 400 naming it;
    a 200 that does not honour it is a silent plain answer."""
    if outcome.status == 200:
        problem = honoured(outcome.body)
        return (PASS, "200, honoured") if problem is None else (FAIL, f"200 but {problem}")
    verdict, why = judge_refusal(outcome, param)
    return verdict, (f"refused, naming why: {why}" if verdict == PASS else why)


def judge_ok(outcome: Outcome, problem: Callable[[Any], str | None],
             detail: Callable[[Any], str] | None = None) -> tuple[str, str]:
    """A request OpenAI answers 200: the body must also pass ``problem`` (None = fine); ``detail`` says what came."""
    if outcome.status != 200:
        shape = error_body_problem(outcome.body) if outcome.status else None
        message = _error_message(outcome.body)
        return FAIL, f"{outcome.got}: {message}" + (f" ({shape})" if shape and outcome.status else "")
    found = problem(outcome.body)
    if found is not None:
        return FAIL, f"200 but {found}"
    try:
        return PASS, f"200: {_short(detail(outcome.body))}" if detail else "200"
    except (KeyError, IndexError, TypeError, AttributeError):  # a detail is for the reader, not part of the verdict
        return PASS, "200"


def judge_accepted(outcome: Outcome, param: str) -> tuple[str, str]:
    """A value inside OpenAI's range: OpenAI answers 200; a clear 400 naming the parameter is a deliberate
    narrower range, anything else a failure."""
    if outcome.status == 200:
        return PASS, "200"
    verdict, why = judge_refusal(outcome, param)
    return (DIFFERENT, f"a narrower range than OpenAI's: {why}") if verdict == PASS else (FAIL, why)


def completion_logprobs_problem(body: dict, top: int, echoed_prompt: str | None = None) -> str | None:
    """``choices[0].logprobs`` as OpenAI's completions give it: per token a logprob and ``top`` alternatives (one
    more where the sampled token is not among them); echoed, the prompt's tokens come first, the very first with
    ``null`` logprob and alternatives."""
    logprobs = (body.get("choices") or [{}])[0].get("logprobs")
    if not isinstance(logprobs, dict):
        return f"logprobs is {logprobs!r}"
    tokens, values, alternatives = (logprobs.get(k) for k in ("tokens", "token_logprobs", "top_logprobs"))
    if not isinstance(tokens, list) or not tokens:
        return "no logprobs.tokens"
    if not isinstance(alternatives, list):
        return f"top_logprobs is {alternatives!r}"
    if not isinstance(values, list) or len(values) != len(tokens) or len(alternatives) != len(tokens):
        return "tokens, token_logprobs and top_logprobs differ in length"
    start = 0
    if echoed_prompt is not None:
        text = body["choices"][0].get("text", "")
        if "".join(tokens) != text or not text.startswith(echoed_prompt):
            return "the echoed prompt's tokens are not in logprobs.tokens"
        generated = (body.get("usage") or {}).get("completion_tokens", 0)
        if len(tokens) <= generated:
            return "no prompt logprobs (only the generated tokens)"
        if values[0] is not None or alternatives[0] is not None:
            return "the first prompt token has a logprob (OpenAI: null)"
        start = 1
    for position, (value, alts) in enumerate(zip(values[start:], alternatives[start:]), start):
        if not isinstance(value, (int, float)) or value > 0:
            return f"token_logprobs[{position}] is {value!r}"
        if not isinstance(alts, dict) or not top <= len(alts) <= top + 1:
            return f"top_logprobs[{position}] has {len(alts) if isinstance(alts, dict) else alts!r} entries, not {top}"
    return None


def chat_logprobs_problem(body: dict, top: int) -> str | None:
    content = ((body.get("choices") or [{}])[0].get("logprobs") or {}).get("content")
    if not content:
        return f"logprobs.content is {content!r}"
    for position, entry in enumerate(content):
        if len(entry.get("top_logprobs") or []) != top:
            return f"content[{position}].top_logprobs has {len(entry.get('top_logprobs') or [])} entries, not {top}"
    return None


def stop_expectation(text: str) -> tuple[str, str] | None:
    """From a greedy answer without ``stop``: a two-character stop string that first occurs after the answer's
    first character (from its second half where one does), and the text the same request with that stop must give
    (everything before it)."""
    half = max(1, len(text) // 2)
    for at in [*range(half, len(text) - 1), *range(1, half)]:
        stop = text[at:at + 2]
        if stop.strip() and text.find(stop) == at:
            return stop, text[:at]
    return None


def json_answer_problem(body: dict, required: tuple[str, ...] = ()) -> str | None:
    content = (body.get("choices") or [{}])[0].get("message", {}).get("content")
    try:
        value = json.loads(content or "")
    except ValueError:
        return f"the content is not JSON (a plain answer): {_short(repr(content))}"
    if not isinstance(value, dict):
        return f"the content is JSON but not an object: {_short(content)}"
    missing = [key for key in required if key not in value]
    return f"the JSON lacks {missing}" if missing else None


def tool_calls_problem(body: dict, names: set[str], *, required: bool) -> str | None:
    """A choice's ``tool_calls`` as OpenAI gives them (a known function, JSON arguments, finish_reason
    ``tool_calls``); none is fine unless the request required one."""
    choice = (body.get("choices") or [{}])[0]
    calls = choice.get("message", {}).get("tool_calls") or []
    if not calls:
        return "no tool_calls though tool_choice required one" if required else None
    for call in calls:
        function = call.get("function") or {}
        if function.get("name") not in names:
            return f"tool_calls names {function.get('name')!r}, not a tool of the request"
        try:
            json.loads(function.get("arguments") or "")
        except ValueError:
            return f"tool_calls arguments are not JSON: {_short(function.get('arguments'))}"
    return None if choice.get("finish_reason") == "tool_calls" else f"finish_reason {choice.get('finish_reason')!r}"


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return _short(str(body["error"].get("message")))
    return _short(json.dumps(body)) if body is not None else ""


def _short(text: Any, limit: int = 110) -> str:
    text = str(text).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _first_text(body: dict) -> str:
    choice = (body.get("choices") or [{}])[0]
    return choice.get("text", choice.get("message", {}).get("content")) or ""


# --- sending ----------------------------------------------------------------------------------------------------

class Probe:
    """One server: the ``openai`` client for requests, an httpx client for the raw wire."""

    def __init__(self, base_url: str, model: str, api_key: str, timeout: float = 120.0):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout)
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {api_key}"},
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        self.connects = 0  # TCP connections the httpx client opened (httpcore's trace)

    def completion(self, **body) -> Outcome:
        return self._send(self.client.completions.with_raw_response.create,
                          **{"model": self.model, "max_tokens": 4, **body})

    def chat(self, **body) -> Outcome:
        return self._send(self.client.chat.completions.with_raw_response.create,
                          **{"model": self.model, "messages": QUESTION, "max_tokens": 8, **body})

    def models(self, name: str) -> Outcome:
        return self._send(self.client.models.with_raw_response.retrieve, name)

    def raw(self, method: str, path: str, body: dict | None = None) -> Outcome:
        try:
            answer = self.http.request(method, path, json=body, extensions={"trace": self._trace})
        except httpx.HTTPError as exc:
            return Outcome(None, None, type(exc).__name__)
        return Outcome(answer.status_code, _json(answer))

    def _trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            self.connects += 1

    @staticmethod
    def _send(create: Callable, *args, **body) -> Outcome:
        try:
            answer = create(*args, **body)
        except openai.APIStatusError as exc:
            return Outcome(exc.status_code, _json(exc.response), type(exc).__name__)
        except openai.APIError as exc:
            return Outcome(None, None, type(exc).__name__)
        return Outcome(answer.status_code, _json(answer.http_response))

    def close(self) -> None:
        self.http.close()
        self.client.close()


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


CHECKS: list[tuple[str, str, str, Callable[[Probe], tuple[Outcome, str, str]]]] = []


def check(name: str, request: str, expects: str):
    def register(run: Callable[[Probe], tuple[Outcome, str, str]]):
        CHECKS.append((name, request, expects, run))
        return run
    return register


@check("completions: prompt list of strings", 'prompt=["3 + 4 =", "12 - 5 ="]', "200, a choice per prompt, index 0, 1")
def _batch_strings(probe):
    outcome = probe.completion(prompt=["3 + 4 =", "12 - 5 ="], temperature=0)
    return outcome, *judge_ok(outcome, lambda b: _indexes_problem(b, 2), _texts)


@check("completions: prompt list of token-id lists", "prompt=[[17, 18, 19], [20, 21]]",
       "200, a choice per prompt, index 0, 1")
def _batch_ids(probe):
    outcome = probe.completion(prompt=[[17, 18, 19], [20, 21]], temperature=0)
    return outcome, *judge_ok(outcome, lambda b: _indexes_problem(b, 2), _texts)


@check("completions: prompt token ids", "prompt=[17, 18, 19]", "200")
def _token_ids(probe):
    outcome = probe.completion(prompt=[17, 18, 19], temperature=0)
    return outcome, *judge_ok(outcome, lambda b: _indexes_problem(b, 1), _texts)


@check("completions: echo", 'prompt="3 + 4 =", echo=true', "200, the text starts with the prompt")
def _echo(probe):
    outcome = probe.completion(prompt="3 + 4 =", echo=True, max_tokens=2, temperature=0)
    return outcome, *judge_ok(outcome, lambda b: None if _first_text(b).startswith("3 + 4 =")
                              else f"the prompt is not echoed: {_short(repr(_first_text(b)))}", _texts)


@check("completions: logprobs N", "logprobs=3, temperature=0", "200, token_logprobs and top_logprobs with 3 entries")
def _logprobs(probe):
    outcome = probe.completion(prompt="3 + 4 =", logprobs=3, max_tokens=3, temperature=0)
    return outcome, *judge_ok(outcome, lambda b: completion_logprobs_problem(b, 3),
                              lambda b: f"{len(b['choices'][0]['logprobs']['tokens'])} tokens, top_logprobs "
                                        f"{[len(a) for a in b['choices'][0]['logprobs']['top_logprobs']]}")


@check("completions: prompt logprobs when echoed", "echo=true, logprobs=1, max_tokens=1 (lm-eval's loglikelihood)",
       "200, the prompt's tokens with logprobs (first null) before the answer's")
def _prompt_logprobs(probe):
    outcome = probe.completion(prompt="3 + 4 = 7", echo=True, logprobs=1, max_tokens=1, temperature=0)
    return outcome, *judge_ok(outcome, lambda b: completion_logprobs_problem(b, 1, echoed_prompt="3 + 4 = 7"),
                              lambda b: f"tokens {b['choices'][0]['logprobs']['tokens']}, token_logprobs[:2] "
                                        f"{[_round(v) for v in b['choices'][0]['logprobs']['token_logprobs'][:2]]}")


@check("completions: suffix", 'suffix=" end"', "inserted before the suffix, or 400 naming suffix")
def _suffix(probe):
    plain = probe.completion(prompt="3 + 4 =", temperature=0)
    outcome = probe.completion(prompt="3 + 4 =", suffix=" end", temperature=0)
    return outcome, *judge_unsupported_or(outcome, "suffix", lambda b: _changed(plain, b, "suffix"))


@check("completions: logit_bias", 'logit_bias={"17": 100}, temperature=0',
       "the bias changes the answer, or 400 naming logit_bias and why")
def _logit_bias(probe):
    plain = probe.completion(prompt="3 + 4 =", temperature=0)
    outcome = probe.completion(prompt="3 + 4 =", logit_bias={"17": 100}, temperature=0)
    return outcome, *judge_unsupported_or(outcome, "logit_bias", lambda b: _changed(plain, b, "logit_bias"))


@check("completions: stop", "stop=[two characters of the greedy answer]",
       "200, the greedy answer cut before the stop string, finish_reason stop")
def _stop(probe):
    plain = probe.completion(prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    expected = stop_expectation(_first_text(plain.body)) if plain.status == 200 else None
    if expected is None:
        return plain, FAIL, f"no greedy answer to take a stop string from ({plain.got}: {_error_message(plain.body)})"
    stop, text = expected
    outcome = probe.completion(prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[stop])

    def problem(body):
        choice = body["choices"][0]
        if choice["text"] != text or choice.get("finish_reason") != "stop":
            return f"text {choice['text']!r} finish_reason {choice.get('finish_reason')!r}; expected {text!r}, stop"
        return None
    return outcome, *judge_ok(outcome, problem, lambda b: f"stop {stop!r}: {b['choices'][0]['text']!r}, "
                                                          f"finish_reason {b['choices'][0]['finish_reason']}")


@check("chat: content parts", 'content=[{"type": "text", "text": ...}]', "200")
def _content_parts(probe):
    outcome = probe.chat(messages=[{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}])
    return outcome, *judge_ok(outcome, lambda b: None, _texts)


@check("chat: tool_calls history", "assistant content=null + tool_calls, then a tool message", "200")
def _tool_history(probe):
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    outcome = probe.chat(messages=messages, tools=[WEATHER])
    return outcome, *judge_ok(outcome, lambda b: None, _texts)


@check("chat: top_logprobs", "logprobs=true, top_logprobs=3", "200, each token with 3 top_logprobs")
def _chat_logprobs(probe):
    outcome = probe.chat(logprobs=True, top_logprobs=3, max_tokens=4)
    return outcome, *judge_ok(outcome, lambda b: chat_logprobs_problem(b, 3), lambda b: (
        f"{len(b['choices'][0]['logprobs']['content'])} tokens x "
        f"{len(b['choices'][0]['logprobs']['content'][0]['top_logprobs'])} top_logprobs"))


@check("chat: response_format json_object", 'response_format={"type": "json_object"}',
       "a JSON object, or 400 naming response_format and why")
def _json_object(probe):
    messages = [{"role": "user", "content": "Answer in JSON with the key answer: what is 2 + 3?"}]
    outcome = probe.chat(messages=messages, response_format={"type": "json_object"}, max_tokens=24)
    return outcome, *judge_unsupported_or(outcome, "response_format", json_answer_problem)


@check("chat: response_format json_schema", "response_format json_schema {answer: integer}, strict",
       "JSON matching the schema, or 400 naming response_format and why")
def _json_schema(probe):
    messages = [{"role": "user", "content": "What is 2 + 3? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    outcome = probe.chat(messages=messages, response_format=fmt, max_tokens=24)
    return outcome, *judge_unsupported_or(outcome, "response_format", lambda b: json_answer_problem(b, ("answer",)))


@check("chat: tools, tool_choice auto", "tools=[weather], tool_choice=auto",
       "200; the tools reach the prompt (prompt_tokens grow); any tool_calls well formed")
def _tools_auto(probe):
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the weather tool."}]
    plain = probe.chat(messages=messages)
    outcome = probe.chat(messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=32)

    before = ((plain.body or {}).get("usage") or {}).get("prompt_tokens") if plain.status == 200 else None

    def problem(body):
        if before is not None and (body.get("usage") or {}).get("prompt_tokens") == before:
            return f"tools ignored: prompt_tokens {before} with and without them"
        return tool_calls_problem(body, {"weather"}, required=False)

    def detail(body):
        calls = _message(body).get("tool_calls")
        answer = (f"tool_calls {[c['function'] for c in calls]}" if calls
                  else f"answered in text (auto allows it): {_message(body).get('content')!r}")
        return f"prompt_tokens {before} -> {body['usage']['prompt_tokens']} with the tools; {answer}"
    return outcome, *judge_ok(outcome, problem, detail)


@check("chat: tool_choice required", "tools=[weather], tool_choice=required", "200 with tool_calls")
def _tools_required(probe):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    outcome = probe.chat(messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=32)
    if outcome.status == 400 and not error_body_problem(outcome.body):
        return outcome, DIFFERENT, f"refused clearly: {_error_message(outcome.body)}"
    return outcome, *judge_ok(outcome, lambda b: tool_calls_problem(b, {"weather"}, required=True),
                              lambda b: f"tool_calls {[c['function'] for c in _message(b)['tool_calls']]}")


@check("range: temperature 3", "completions temperature=3", "400 param=temperature")
def _temperature(probe):
    outcome = probe.completion(prompt="a", temperature=3)
    return outcome, *judge_refusal(outcome, "temperature")


@check("range: frequency_penalty 3", "completions frequency_penalty=3", "400 param=frequency_penalty")
def _frequency_penalty(probe):
    outcome = probe.completion(prompt="a", frequency_penalty=3)
    return outcome, *judge_refusal(outcome, "frequency_penalty")


@check("range: top_logprobs 30", "chat logprobs=true, top_logprobs=30", "400 param=top_logprobs")
def _top_logprobs(probe):
    outcome = probe.chat(logprobs=True, top_logprobs=30)
    return outcome, *judge_refusal(outcome, "top_logprobs")


@check("range: seed 2**63", "completions seed=2**63", "400 param=seed")
def _seed(probe):
    outcome = probe.completion(prompt="a", seed=2 ** 63)
    return outcome, *judge_refusal(outcome, "seed")


@check("range: seed -1", "completions seed=-1", "200 (OpenAI's seed is any int64)")
def _seed_negative(probe):
    outcome = probe.completion(prompt="a", seed=-1, max_tokens=1)
    return outcome, *judge_accepted(outcome, "seed")


@check("range: seed 2**63-1", "completions seed=2**63-1", "200 (OpenAI's seed is any int64)")
def _seed_largest(probe):
    outcome = probe.completion(prompt="a", seed=2 ** 63 - 1, max_tokens=1)
    return outcome, *judge_accepted(outcome, "seed")


@check("prompt [999999]", "completions prompt=[999999] (outside the vocabulary), raw httpx",
       "400 param=prompt[0], never a 500")
def _out_of_vocabulary(probe):
    probe.raw("GET", "/models")  # open the connection the next two checks share
    outcome = probe.raw("POST", "/completions", {"model": probe.model, "prompt": [999999], "max_tokens": 1})
    return outcome, *judge_refusal(outcome, "prompt")


@check("keep-alive after the error", "the same httpx client's next request",
       "200 on the same TCP connection")
def _keep_alive(probe):
    opened = probe.connects
    outcome = probe.raw("POST", "/completions", {"model": probe.model, "prompt": "a", "max_tokens": 1})
    if outcome.status is None:
        return outcome, FAIL, f"no HTTP answer ({outcome.exception}): the server closed the kept-alive connection"
    if outcome.status != 200:
        return outcome, FAIL, f"{outcome.got}: {_error_message(outcome.body)}"
    if probe.connects != opened:
        return outcome, FAIL, "200 but on a new TCP connection: the error dropped the kept-alive one"
    return outcome, PASS, f"200 on the same connection ({probe.connects} opened in all)"


@check("error body shape", "raw POST /completions temperature=3",
       '400 {"error": {message, type, param, code}}, not 422 {"detail": [...]}')
def _error_shape(probe):
    outcome = probe.raw("POST", "/completions", {"model": probe.model, "prompt": "a", "temperature": 3})
    if outcome.status == 400 and not error_body_problem(outcome.body):
        return outcome, PASS, f"400 {json.dumps(outcome.body)[:100]}"
    return outcome, FAIL, f"{outcome.status}: {error_body_problem(outcome.body) or 'status not 400'}"


@check("GET /v1/models/{model}", "models.retrieve(model)", "200, id = the model")
def _model(probe):
    outcome = probe.models(probe.model)
    return outcome, *judge_ok(outcome, lambda b: None if b.get("id") == probe.model else f"id {b.get('id')!r}")


@check("GET /v1/models/{unknown}", 'models.retrieve("no-such-model")', "404 NotFoundError in the error shape")
def _unknown_model(probe):
    outcome = probe.models("no-such-model")
    if outcome.status == 404 and not error_body_problem(outcome.body):
        return outcome, PASS, f"404: {_error_message(outcome.body)}"
    return outcome, FAIL, f"{outcome.got}: {error_body_problem(outcome.body) or _error_message(outcome.body)}"


def _texts(body: dict) -> str:
    return " | ".join(repr(choice.get("text", (choice.get("message") or {}).get("content")))
                      for choice in body.get("choices") or [])


def _message(body: dict) -> dict:
    return body["choices"][0]["message"]


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def _indexes_problem(body: dict, count: int) -> str | None:
    indexes = [choice.get("index") for choice in body.get("choices") or []]
    return None if indexes == list(range(count)) else f"choice indexes {indexes}, expected {list(range(count))}"


def _changed(plain: Outcome, body: dict, param: str) -> str | None:
    """A parameter that changes a greedy answer was used; the same text as without it means it was ignored."""
    if plain.status == 200 and _first_text(plain.body) == _first_text(body):
        return f"the answer is the one without {param}: silently ignored"
    return None


def run_checks(probe: Probe) -> list[Row]:
    rows = []
    for name, request, expects, run in CHECKS:
        try:
            outcome, verdict, why = run(probe)
        except Exception as exc:  # a report goes on: a check that breaks is one FAIL row
            outcome, verdict, why = Outcome(None, None, type(exc).__name__), FAIL, _short(f"check broke: {exc}")
        rows.append(Row(name, request, expects, outcome.got, verdict, why))
    return rows


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for column in ("check", "request", "OpenAI's API", "got", "verdict", "why"):
        table.add_column(column, overflow="fold")
    colour = {PASS: "green", FAIL: "red", DIFFERENT: "yellow"}
    for row in rows:
        table.add_row(*map(escape, (row.check, row.request, row.expects, row.got)),
                      f"[{colour[row.verdict]}]{row.verdict}[/]", escape(row.why))
    Console(width=200).print(table)
    counts = {verdict: sum(row.verdict == verdict for row in rows) for verdict in (PASS, DIFFERENT, FAIL)}
    print(", ".join(f"{verdict} {count}" for verdict, count in counts.items()), f"of {len(rows)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's /v1 URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--api-key", default="none", help="the server's key (default: none)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file as JSON")
    args = parser.parse_args(argv)
    probe = Probe(args.base_url, args.model, args.api_key)
    try:
        rows = run_checks(probe)
    finally:
        probe.close()
    print_table(rows, f"OpenAI API conformance of {args.base_url} ({args.model})")
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return 0  # a report: the rows say what conforms


if __name__ == "__main__":
    raise SystemExit(main())
