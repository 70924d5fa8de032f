"""Serve mode refuses every bad value of every field, before it reaches the engine or a topic. The bad values are
GENERATED from the request models' JSON schema (``api_models.REQUEST_MODELS``): for each field of each route, one
of the wrong type, the non-finite numbers (JSON can carry NaN and Infinity, as Python's json.dumps writes them,
and 1e999), values out of range and oversized ones. A new field is covered without a new test (and one without
bounds fails the first test). One server (the real broker, the tiny model) for the module."""
from __future__ import annotations

import copy
import json
import math
import threading
import uuid

import httpx
import openai
import pytest

from streamrft.config import load_config
from streamrft.consumers.serve.api_models import REQUEST_MODELS
from streamrft.schemas import Experience

from .roles import read_all
from .test_serve import KEY, QUESTION, serve_config, serving

pytestmark = [pytest.mark.kafka, pytest.mark.model]

AUTH = {"Authorization": f"Bearer {KEY}"}
RAW = "__raw__"  # a JSON token json.dumps cannot write (1e999), put into the body text as it is


@pytest.fixture(scope="module")
def served(kafka_bootstrap, tiny_model_dir, tmp_path_factory):
    def make(**overrides):
        base = {"name": f"t{uuid.uuid4().hex[:10]}", "kafka": {"bootstrap_servers": kafka_bootstrap}}
        return load_config(overrides={**base, **overrides}, env={})

    config = serve_config(make, tiny_model_dir, tmp_path_factory.mktemp("serve-validation"))
    with serving(config) as (clients, role, base, client):
        yield config, clients, role, base, client


def written(config, clients, response_id: str) -> list[Experience]:
    """The experiences of one response on ``experiences`` (the module's tests share the topic)."""
    return [e for e in read_all(config, clients.bootstrap, "experiences", clients.serde, Experience, idle=1)
            if e.eid.startswith(f"{response_id}/")]


# -- the bad values, from the schema -----------------------------------------------------------------------------
def _resolve(node: dict, defs: dict) -> dict:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _variants(node: dict, defs: dict) -> list[dict]:
    node = _resolve(node, defs)
    if "anyOf" not in node:
        return [node]
    return [v for n in node["anyOf"] for v in _variants(n, defs) if v.get("type") != "null"]


def fields(model) -> list[tuple[tuple, list[dict]]]:
    """(path, variants) of every field, nested ones included (a list's items at index 0)."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    out = []

    def walk(path: tuple, node: dict) -> None:
        variants = _variants(node, defs)
        out.append((path, variants))
        for variant in variants:
            for name, child in variant.get("properties", {}).items():
                walk(path + (name,), child)
            if variant.get("type") == "array" and "items" in variant:
                walk(path + (0,), variant["items"])

    for name, node in schema["properties"].items():
        walk((name,), node)
    return out


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def bad_values(variants: list[dict]) -> list[tuple[str, object]]:
    kinds = {v.get("type", "object") for v in variants} | ({"number"} if any(v.get("type") == "integer"
                                                                              for v in variants) else set())
    accepted = kinds | ({"integer"} if "number" in kinds else set())
    wrong = next(v for v in ({"x": 1}, "text", 12345, True, [1]) if _json_type(v) not in accepted)
    cases = [("wrong type", wrong)]
    for v in variants:
        kind = v.get("type")
        if kind in ("integer", "number"):
            cases += [("non-finite", float("nan")), ("non-finite", float("inf")), ("non-finite", -float("inf")),
                      ("non-finite", RAW + "1e999")]
            step = 1 if kind == "integer" else 0.5
            if "minimum" in v:
                cases.append(("out of range", v["minimum"] - step))
            if "exclusiveMinimum" in v:
                cases.append(("out of range", v["exclusiveMinimum"]))
            if "maximum" in v:
                cases.append(("out of range", v["maximum"] + step))
            cases.append(("oversized", 10 ** 30))
        elif kind == "string":
            if "enum" in v or "const" in v:
                cases.append(("out of range", "not-one-of-them"))
            if "pattern" in v:
                cases.append(("out of range", "has a space/and a slash"))
            if v.get("minLength", 0) > 0:
                cases.append(("out of range", ""))
            if "maxLength" in v:  # an enum has none: its values are its bound
                cases.append(("oversized", "a" * (v["maxLength"] + 1)))
        elif kind == "array":
            items = v.get("items", {})
            item = 1 if items.get("type") == "integer" else "a" if items.get("type") == "string" else {}
            cases.append(("oversized", [item] * (v["maxItems"] + 1)))
            if v.get("minItems", 0) > 0:
                cases.append(("out of range", []))
    return cases


def with_value(body: dict, path: tuple, value) -> str:
    """``body`` with ``value`` at ``path``, as JSON text (NaN and Infinity as Python's json.dumps writes them)."""
    body = copy.deepcopy(body)
    node = body
    for part, inner in zip(path, path[1:]):  # made where the good body has none: [{}] or {}
        child = node[part] if isinstance(node, list) or part in node else None
        if isinstance(inner, int) and not isinstance(child, list):
            child = [{}]
        elif isinstance(inner, str) and not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[path[-1]] = value
    text = json.dumps(body)
    if isinstance(value, str) and value.startswith(RAW):
        text = text.replace(json.dumps(value), value.removeprefix(RAW))
    return text


def test_every_field_of_every_request_model_has_a_type_and_bounds():
    """What the generated test relies on, and what a new field must declare: numbers a range, strings and lists
    a length."""
    for route, model in REQUEST_MODELS.items():
        for path, variants in fields(model):
            for v in variants:
                where = f"{route} {'.'.join(map(str, path))}"
                if v.get("type") in ("integer", "number"):
                    assert ("minimum" in v or "exclusiveMinimum" in v) and "maximum" in v, where
                elif v.get("type") == "string" and "enum" not in v and "const" not in v:
                    assert "maxLength" in v, where
                elif v.get("type") == "array":
                    assert "maxItems" in v, where
                else:
                    assert v.get("type") in ("boolean", "object", "string") or "$ref" in v, (where, v)


def test_every_bad_value_of_every_field_is_refused_and_nothing_is_written(served):
    config, clients, role, base, client = served
    chat = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
    bodies = {"/v1/chat/completions": {"model": "tiny", "messages": QUESTION, "max_tokens": 1},
              "/v1/completions": {"model": "tiny", "prompt": "3 + 4 =", "max_tokens": 1},
              "/feedback": {"response_id": chat.id, "choice": 0, "reward": 1.0}}
    pending = len(role.pending)
    sent = 0
    with httpx.Client(base_url=base, headers={**AUTH, "Content-Type": "application/json"}, timeout=30) as http:
        for route, model in REQUEST_MODELS.items():
            for path, variants in fields(model):
                name = ".".join(f"[{p}]" if isinstance(p, int) else p for p in path).replace(".[", "[")
                for what, value in bad_values(variants):
                    answer = http.post(route, content=with_value(bodies[route], path, value))
                    sent += 1
                    case = f"{route} {name} {what} {str(value)[:40]!r}: {answer.status_code} {answer.text[:300]}"
                    assert answer.status_code in (400, 413), case
                    error = answer.json()["error"]
                    assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"], case
                    if answer.status_code != 413:
                        assert error["param"] is not None and error["param"].startswith(name), case
                        assert "allowed:" in error["message"], case
    assert sent > 100
    assert len(role.pending) == pending  # no bad request reached the engine
    assert written(config, clients, chat.id) == []
    for route, body in bodies.items():  # the bodies the bad values were put in are good ones
        assert httpx.post(f"{base}{route}", json=body, headers=AUTH, timeout=30).status_code == 200, route


def test_the_openai_client_gets_400_naming_the_field_and_its_range(served):
    client = served[4]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=QUESTION, temperature=5)
    assert refused.value.status_code == 400 and refused.value.param == "temperature"
    assert "[0, 2]" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="3 + 4 =", top_p=1.5, max_tokens=1)
    assert refused.value.param == "top_p" and "(0, 1]" in refused.value.message
    # the openai client never sends NaN (it refuses to write it); Python's json and other clients do, which the
    # generated test above sends
    with pytest.raises(ValueError, match="not JSON compliant"):
        client.completions.create(model="tiny", prompt="3 + 4 =", top_p=float("nan"), max_tokens=1)


def test_limits_of_this_server_and_model_are_checked_before_the_engine(served):
    """The vocabulary, the model's context and serve.max_n, named like the body's own limits; a request with a
    token id outside the vocabulary, sent while another runs, leaves that one unharmed."""
    _, _, role, base, client = served
    vocab, context = role.engine.vocab_size, role.engine.max_model_len

    def refused(route: str, **body) -> dict:
        answer = httpx.post(f"{base}{route}", json={"model": "tiny", **body}, headers=AUTH, timeout=30)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    results = {}
    beside = threading.Thread(target=lambda: results.setdefault("ok", client.completions.create(
        model="tiny", prompt=[5, 9, 11], max_tokens=8, n=4)))
    beside.start()
    error = refused("/v1/completions", prompt=[5, vocab, 7], max_tokens=1)
    assert error["param"] == "prompt[1]" and f"[0, {vocab - 1}]" in error["message"]
    beside.join(60)
    assert len(results["ok"].choices) == 4  # the request beside it is answered
    assert refused("/v1/completions", prompt=[5, -1], max_tokens=1)["param"].startswith("prompt")
    error = refused("/v1/completions", prompt=[5] * 10, max_tokens=context)
    assert error["param"] == "max_tokens" and f"[1, {context - 10}]" in error["message"]
    assert refused("/v1/completions", prompt=[5] * context, max_tokens=1)["code"] == "context_length_exceeded"
    error = refused("/v1/chat/completions", messages=QUESTION, n=role.settings.max_n + 1)
    assert error["param"] == "n" and f"[1, {role.settings.max_n}]" in error["message"]


def test_a_feedback_reward_must_be_a_finite_number_and_409_is_for_conflicts_only(served):
    config, clients, _, base, client = served
    chat = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)

    def feedback(reward_json: str) -> httpx.Response:
        body = '{"response_id": "%s", "choice": 0, "reward": %s}' % (chat.id, reward_json)
        return httpx.post(f"{base}/feedback", content=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=30)

    for bad in ("NaN", "Infinity", "-Infinity", "1e999", '"1.0"', "true", "null", "[1]", "1e7"):
        answer = feedback(bad)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "reward", (bad, answer.text)
    assert written(config, clients, chat.id) == []
    assert feedback("0.5").status_code == 200
    assert feedback("0.5").status_code == 200  # the same feedback again: answered from its receipt
    assert feedback("1").status_code == 409  # a second, different reward for the same choice: a conflict
    assert feedback('"0.5"').status_code == 400  # a wrong type stays invalid, not a conflict
    assert feedback("NaN").status_code == 400
    (experience,) = written(config, clients, chat.id)
    assert experience.reward == 0.5 and math.isfinite(experience.reward)
