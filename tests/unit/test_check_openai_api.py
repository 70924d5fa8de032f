"""scripts/check_openai_api.py's judging: what counts as OpenAI's answer, a clear refusal, or a silent one."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_openai_api", ROOT / "scripts" / "check_openai_api.py")
check = sys.modules.setdefault("check_openai_api", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(check)  # registered first: its dataclasses look their module up
Outcome, PASS, FAIL, DIFFERENT = check.Outcome, check.PASS, check.FAIL, check.DIFFERENT


def error(param: str | None, message: str = "temperature: must be in [0, 2]") -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


FASTAPI_422 = {"detail": [{"type": "less_than_equal", "loc": ["body", "temperature"], "msg": "Input should be..."}]}


@pytest.mark.parametrize("body, problem", [
    (error("temperature"), None),
    (error(None), None),
    (FASTAPI_422, "body is not {'error': {...}} (has ['detail'])"),
    ({"error": {"message": "x", "type": "t"}}, "error object lacks ['code', 'param']"),
    ({"error": {"message": "", "type": "t", "param": None, "code": None}}, "error.message is not a non-empty string"),
    ("Internal Server Error", "body is not {'error': {...}} (has str)"),
])
def test_error_body_shape(body, problem):
    assert check.error_body_problem(body) == problem


@pytest.mark.parametrize("outcome, verdict, words", [
    (Outcome(400, error("temperature"), "BadRequestError"), PASS, "param=temperature"),
    (Outcome(400, error("prompt[0]"), "BadRequestError"), PASS, "param=prompt[0]"),
    (Outcome(400, error("messages[0].content"), None), DIFFERENT, "not 'prompt'"),
    (Outcome(400, FASTAPI_422, "BadRequestError"), FAIL, "400 but body is not"),
    (Outcome(422, FASTAPI_422, "UnprocessableEntityError"), FAIL, "FastAPI's validation status"),
    (Outcome(200, {"choices": []}), FAIL, "accepted silently"),
    (Outcome(500, "Internal Server Error", "InternalServerError"), FAIL, "500"),
    (Outcome(None, None, "APIConnectionError"), FAIL, "no HTTP answer (APIConnectionError)"),
])
def test_a_refusal_is_400_in_openais_shape_naming_the_parameter(outcome, verdict, words):
    param = "prompt" if words in ("param=prompt[0]", "not 'prompt'") else "temperature"
    got, why = check.judge_refusal(outcome, param)
    assert got == verdict and words in why, why


def test_a_parameter_the_engine_cannot_do_is_honoured_or_refused_never_silently_ignored():
    honoured = lambda body: None if body["choices"][0]["text"] == "{}" else "not JSON"  # noqa: E731
    refusal = Outcome(400, error("response_format", "response_format: needs guided decoding"), "BadRequestError")
    assert check.judge_unsupported_or(refusal, "response_format", honoured)[0] == PASS
    assert "refused, naming why" in check.judge_unsupported_or(refusal, "response_format", honoured)[1]
    assert check.judge_unsupported_or(Outcome(200, {"choices": [{"text": "{}"}]}), "x", honoured) == (
        PASS, "200, honoured")
    assert check.judge_unsupported_or(Outcome(200, {"choices": [{"text": "hi"}]}), "x", honoured) == (
        FAIL, "200 but not JSON")
    assert check.judge_unsupported_or(Outcome(422, FASTAPI_422), "x", honoured)[0] == FAIL


def test_a_value_in_openais_range_is_accepted_or_a_clear_narrower_range():
    assert check.judge_accepted(Outcome(200, {}), "seed") == (PASS, "200")
    verdict, why = check.judge_accepted(Outcome(400, error("seed", "seed: in [0, 2^62]")), "seed")
    assert verdict == DIFFERENT and "narrower range" in why
    assert check.judge_accepted(Outcome(422, FASTAPI_422), "seed")[0] == FAIL


def test_an_ok_answer_must_also_have_what_was_asked():
    body = {"choices": [{"index": 0, "text": "7"}]}
    assert check.judge_ok(Outcome(200, body), lambda b: None, check._texts) == (PASS, "200: '7'")
    assert check.judge_ok(Outcome(200, body), lambda b: "no echo") == (FAIL, "200 but no echo")
    assert check.judge_ok(Outcome(200, body), lambda b: None, lambda b: b["missing"]) == (PASS, "200")
    verdict, why = check.judge_ok(Outcome(422, FASTAPI_422, "UnprocessableEntityError"), lambda b: None)
    assert verdict == FAIL and why.startswith("422 UnprocessableEntityError") and "has ['detail']" in why


def completion(tokens, values, alternatives, text=None, completion_tokens=1):
    return {"choices": [{"text": text if text is not None else "".join(tokens),
                         "logprobs": {"tokens": tokens, "token_logprobs": values, "top_logprobs": alternatives}}],
            "usage": {"completion_tokens": completion_tokens}}


def test_completion_logprobs_have_that_many_alternatives_per_token():
    good = completion([" 7", "."], [-0.1, -0.5], [{" 7": -0.1, " 8": -2.0}, {".": -0.5, ",": -1.0}])
    assert check.completion_logprobs_problem(good, 2) is None
    assert check.completion_logprobs_problem(good, 1) is None  # the sampled token beside the one most likely
    assert "has 2 entries, not 3" in check.completion_logprobs_problem(good, 3)
    assert check.completion_logprobs_problem(completion([" 7"], [-0.1], None), 1) == "top_logprobs is None"
    assert check.completion_logprobs_problem({"choices": [{"text": "7", "logprobs": None}]}, 1) == "logprobs is None"
    assert "token_logprobs[0]" in check.completion_logprobs_problem(completion([" 7"], [0.5], [{" 7": 0.5}]), 1)


def test_echoed_prompt_logprobs_come_first_with_a_null_first_token():
    echoed = completion(["3", " +", " 4", " 7"], [None, -3.2, -1.0, -0.4],
                        [None, {" +": -3.2}, {" 4": -1.0}, {" 7": -0.4}])
    assert check.completion_logprobs_problem(echoed, 1, echoed_prompt="3 + 4") is None
    only_answer = completion([" 7"], [-0.4], [{" 7": -0.4}], text="3 + 4 7")
    assert "not in logprobs.tokens" in check.completion_logprobs_problem(only_answer, 1, echoed_prompt="3 + 4")
    not_echoed = completion([" 7"], [-0.4], [{" 7": -0.4}])
    assert "not in logprobs.tokens" in check.completion_logprobs_problem(not_echoed, 1, echoed_prompt="3 + 4")
    first_valued = completion(["3", " 7"], [-1.0, -0.4], [{"3": -1.0}, {" 7": -0.4}])
    assert "first prompt token" in check.completion_logprobs_problem(first_valued, 1, echoed_prompt="3")
    generated_only = completion(["3", " 7"], [None, -0.4], [None, {" 7": -0.4}], completion_tokens=2)
    assert "no prompt logprobs" in check.completion_logprobs_problem(generated_only, 1, echoed_prompt="3")


def test_chat_top_logprobs_have_exactly_that_many_entries():
    def chat(counts):
        return {"choices": [{"logprobs": {"content": [
            {"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "a", "logprob": -1.0}] * n} for n in counts]}}]}
    assert check.chat_logprobs_problem(chat([3, 3]), 3) is None
    assert check.chat_logprobs_problem(chat([3, 0]), 3) == "content[1].top_logprobs has 0 entries, not 3"
    assert check.chat_logprobs_problem({"choices": [{"logprobs": None}]}, 3) == "logprobs.content is None"


@pytest.mark.parametrize("text, expected", [
    (" 5, 6, 7", ("6,", " 5, ")),  # from the second half
    (" 5, 5,", ("5,", " ")),  # the second half's pieces all occur earlier
    ("aaaa", None),  # every two-character piece first occurs at the start
    ("ab", None),
    ("", None),
    ("a  b", (" b", "a ")),  # a piece of spaces only cannot be a stop string
])
def test_the_stop_string_is_taken_from_the_greedy_answer_after_its_start(text, expected):
    assert check.stop_expectation(text) == expected
    if expected:
        stop, before = expected
        assert text.find(stop) == len(before) > 0


def chat_message(content=None, tool_calls=None, finish_reason="stop"):
    return {"choices": [{"message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
                         "finish_reason": finish_reason}]}


def test_json_answers():
    assert check.json_answer_problem(chat_message('{"answer": 5}'), ("answer",)) is None
    assert check.json_answer_problem(chat_message('{"other": 5}'), ("answer",)) == "the JSON lacks ['answer']"
    assert "not JSON (a plain answer)" in check.json_answer_problem(chat_message("The answer is 5"))
    assert "not an object" in check.json_answer_problem(chat_message("[5]"))
    assert "not JSON" in check.json_answer_problem(chat_message(None))


def test_tool_calls_as_openai_gives_them():
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    assert check.tool_calls_problem(chat_message(None, [call], "tool_calls"), {"weather"}, required=True) is None
    assert check.tool_calls_problem(chat_message("sunny"), {"weather"}, required=False) is None
    assert "tool_choice required" in check.tool_calls_problem(chat_message("sunny"), {"weather"}, required=True)
    assert "finish_reason 'stop'" in check.tool_calls_problem(chat_message(None, [call]), {"weather"}, required=True)
    other = {**call, "function": {"name": "search", "arguments": "{}"}}
    assert "not a tool of the request" in check.tool_calls_problem(
        chat_message(None, [other], "tool_calls"), {"weather"}, required=False)
    broken = {**call, "function": {"name": "weather", "arguments": "{city"}}
    assert "not JSON" in check.tool_calls_problem(chat_message(None, [broken], "tool_calls"), {"weather"},
                                                  required=False)


def test_every_request_of_the_list_has_one_check():
    names = [name for name, *_ in check.CHECKS]
    assert len(names) == len(set(names))
    for wanted in ("prompt list of strings", "prompt list of token-id lists", "echo", "logprobs N",
                   "prompt logprobs when echoed", "suffix", "logit_bias", "stop", "content parts",
                   "tool_calls history", "top_logprobs", "json_object", "json_schema", "tool_choice",
                   "temperature 3", "frequency_penalty 3", "top_logprobs 30", "seed 2**63", "prompt [999999]",
                   "keep-alive", "error body shape", "GET /v1/models/{model}", "GET /v1/models/{unknown}"):
        assert any(wanted in name for name in names), wanted


def test_a_server_that_does_not_answer_is_one_fail_row_per_check_and_exit_code_0(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert check.main(["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(check.CHECKS) and {row["verdict"] for row in rows} == {FAIL}
    assert "FAIL" in capsys.readouterr().out
