"""Serve mode's error answers, in OpenAI's shape (``{"error": {message, type, param, code}}``, which its clients
read; the same object under ``detail`` for clients of FastAPI's shape), for every status: a refused body is 400
(not FastAPI's 422), an unknown route 404, a wrong method 405. A refused request body names the field and what
the field allows, described from the request model's JSON schema, so the answer follows the model; a parameter
this server does not support is named as such. Answers never carry exception text: what failed inside is in the
server's log."""
from __future__ import annotations

from functools import cache
from typing import Any

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api_models import REQUEST_MODELS

INTERNAL = "the server failed this request; its log has the cause"


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None, headers: dict[str, str] | None = None) -> HTTPException:
    return HTTPException(status, detail={"message": message, "type": kind, "param": param, "code": code},
                         headers=headers)


def answer(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": body, "detail": body}, headers=headers)


def http_error(exc: StarletteHTTPException) -> JSONResponse:
    """Any HTTPException, raised here (``error``) or by the framework (an unknown route, a wrong method)."""
    if isinstance(exc.detail, dict):
        body = exc.detail
    else:
        known = {404: ("the route does not exist; this server serves /v1/chat/completions, /v1/completions, "
                       "/v1/models, /feedback, /health and /metrics", "not_found"),
                 405: ("the route does not take this method", "method_not_allowed")}
        message, code = known.get(exc.status_code, (str(exc.detail), None))
        body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return answer(exc.status_code, body, getattr(exc, "headers", None))


def refused_body(path: str, exc: RequestValidationError) -> JSONResponse:
    """400 (OpenAI's status for an invalid value): the first refused field, what it allows and (cut short)
    what came; a parameter the model does not have is one this server does not support."""
    errors = list(exc.errors())
    # a value refused by every variant of a union gets an error per variant: the one that went deepest, and
    # then one that names a limit (not "should be a string"), is about the variant the client meant; of errors
    # as deep, a value sent comes before a neighbour not sent
    first = max(errors, key=lambda e: (len(e["loc"]), e["type"] != "missing", not e["type"].endswith("_type"))
                ) if errors else None
    model = REQUEST_MODELS.get(path)
    if first is None:
        return answer(400, {"message": "the request body is invalid", "type": "invalid_request_error",
                            "param": None, "code": "invalid_value"})
    loc = [p for p in first["loc"] if p != "body"]
    if first["type"] == "extra_forbidden":
        param = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
        return answer(400, {"message": f"{param}: this server does not support the parameter "
                                       f"{str(loc[-1])!r}; send the request without it",
                            "type": "invalid_request_error", "param": param, "code": "unsupported_parameter"})
    param, schema = _follow(model, loc) if model is not None else (None, None)
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if first["type"] not in ("json_invalid", "missing") and "input" in first:
        message += f" (got {_short(first['input'])})"
    if schema is not None:
        message += f"; allowed: {describe(schema)}"
    return answer(400, {"message": message, "type": "invalid_request_error", "param": param,
                           "code": first["type"]})


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _follow(model: type[BaseModel], loc: list) -> tuple[str | None, dict | None]:
    """The dotted name of the field at ``loc`` (a validation error's location, less pydantic's union tags) and
    its JSON schema."""
    root = _schema(model)
    defs = root.get("$defs", {})
    node, param = root, ""
    for part in loc:
        node = _resolve(node, defs)
        if isinstance(part, int):
            array = next((v for v in _variants(node, defs) if v.get("type") == "array"), None)
            if array is None:
                return param or None, None
            node, param = array.get("items", {}), f"{param}[{part}]"
            continue
        owner = next((v for v in _variants(node, defs) if part in v.get("properties", {})), None)
        if owner is not None:
            node, param = owner["properties"][part], f"{param}.{part}" if param else str(part)
        else:  # a union tag ("str", "list[constrained-int]"): the variant of that type
            node = next((v for v in _variants(node, defs) if _is_tagged(v, str(part), defs)), node)
    return param or None, _resolve(node, defs)


def _is_tagged(node: dict, tag: str, defs: dict) -> bool:
    """Whether ``node`` is the union variant pydantic's ``tag`` names (its type, and its items' for a list)."""
    name = tag.removeprefix("constrained-")
    kind = "array" if name.startswith("list[") else {"str": "string", "int": "integer", "float": "number",
                                                      "bool": "boolean"}.get(name)
    if node.get("type") != kind:
        return False
    if kind != "array":
        return True
    inner = tag[len("list["):-1]
    return any(_is_tagged(v, inner, defs) for v in _variants(_resolve(node.get("items", {}), defs), defs))


@cache
def _schema(model: type[BaseModel]) -> dict:  # ~10 ms to build: once per model, not per refusal
    return model.model_json_schema()


def _resolve(node: dict, defs: dict) -> dict:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _variants(node: dict, defs: dict) -> list[dict]:
    if "anyOf" not in node:
        return [node]
    return [v for variant in node["anyOf"] for v in _variants(_resolve(variant, defs), defs)]


def describe(node: dict) -> str:
    """What a JSON schema allows, in words: ``a number in [0, 2]``, ``a string of at most 200 characters``."""
    if "anyOf" in node:
        kinds = [describe(v) for v in node["anyOf"] if v.get("type") != "null"]
        return " or ".join(kinds) + (" or null" if len(kinds) < len(node["anyOf"]) else "")
    if "enum" in node or "const" in node:
        return "one of " + ", ".join(repr(v) for v in node.get("enum", [node.get("const")]))
    kind = node.get("type")
    if kind in ("integer", "number"):
        low = ("[", node["minimum"]) if "minimum" in node else ("(", node.get("exclusiveMinimum", "-inf"))
        high = (node["maximum"], "]") if "maximum" in node else (node.get("exclusiveMaximum", "inf"), ")")
        what = "an integer" if kind == "integer" else "a finite number"
        return f"{what} in {low[0]}{low[1]}, {high[0]}{high[1]}"
    if kind == "string":
        pattern = f" matching {node['pattern']}" if "pattern" in node else ""
        return f"a string of {node.get('minLength', 0)} to {node.get('maxLength', 'any number of')} " \
               f"characters{pattern}"
    if kind == "array":
        items = describe(node["items"]) if "items" in node else "anything"
        return f"a list of {node.get('minItems', 0)} to {node.get('maxItems', 'any number of')} items, each {items}"
    if kind == "boolean":
        return "true or false"
    if kind == "object" or "properties" in node:
        return "an object with " + ", ".join(node.get("properties", {})) if node.get("properties") else "an object"
    return kind or "a value"
