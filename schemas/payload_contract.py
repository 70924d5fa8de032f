"""The payload contract: a JSON Schema per built-in workflow (``payloads/<workflow>.schema.json``) and per
built-in reward (``payloads/rewards/<reward>.schema.json``), published beside the ``.avsc`` files, so a producer
in any language knows which keys a task's ``payload`` needs without reading the workflows' code.

A task's payload is checked against its workflow's schema and against the schema of the reward that scores it
(its ``reward_fn``, else the workflow's default, ``x-streamrft-default-reward`` in the workflow's schema). Keys a
schema does not list are allowed: a judge's prompt template may name any. A workflow or reward without a schema
(a plugin) is not checked here: it fails the task at the worker, with its own message, as before.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from jsonschema import Draft202012Validator

PAYLOAD_DIR = Path(__file__).parent / "payloads"
REWARD_DIR = PAYLOAD_DIR / "rewards"
DEFAULT_REWARD = "x-streamrft-default-reward"  # the reward of a task that names none
DERIVES = "x-streamrft-derives"  # key -> the keys the workflow computes it from, for the reward's check


class PayloadError(ValueError):
    """A payload its workflow's or reward's schema refuses; ``field`` is the key at fault ('' for the whole)."""

    def __init__(self, field: str, detail: str):
        self.field = field
        super().__init__(detail)


def workflow_schema_path(workflow: str) -> Path:
    return PAYLOAD_DIR / f"{workflow}.schema.json"


def reward_schema_path(reward: str) -> Path:
    return REWARD_DIR / f"{reward}.schema.json"


@cache
def _validator(path: Path) -> Draft202012Validator | None:
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def published_workflows() -> list[str]:
    """The workflows whose payload has a published schema."""
    return sorted(path.name.removesuffix(".schema.json") for path in PAYLOAD_DIR.glob("*.schema.json"))


def published_rewards() -> list[str]:
    return sorted(path.name.removesuffix(".schema.json") for path in REWARD_DIR.glob("*.schema.json"))


def check_payload(workflow: str, reward_fn: str | None, payload: dict) -> None:
    """Raise :class:`PayloadError` naming the key when ``payload`` breaks the schema of ``workflow`` or of the
    reward that scores it (``reward_fn``, else the workflow's default)."""
    # a path made of a name: "../x" must not reach a file outside the payloads folder
    if "/" in workflow or "\\" in workflow or workflow.startswith("."):
        return
    validator = _validator(workflow_schema_path(workflow))
    if validator is not None:
        _check(validator, payload, f"workflow {workflow}", f"schemas/payloads/{workflow}.schema.json")
    schema = validator.schema if validator is not None else {}
    reward = reward_fn or schema.get(DEFAULT_REWARD)
    if reward and "/" not in reward and not reward.startswith("."):
        scorer = _validator(reward_schema_path(reward))
        if scorer is not None:
            _check(scorer, _with_derived(payload, schema.get(DERIVES, {})), f"reward {reward}",
                   f"schemas/payloads/rewards/{reward}.schema.json")


def _with_derived(payload: dict, derives: dict[str, list[str]]) -> dict:
    """The payload as the reward sees it: keys the workflow derives from others (arithmetic's answer from a and
    b) are there when those others are (with a stand-in value: the workflow computes the real one)."""
    made = {key: 0 for key, sources in derives.items() if key not in payload and all(s in payload for s in sources)}
    return {**payload, **made} if made else payload


def _check(validator: Draft202012Validator, payload: dict, whose: str, where: str) -> None:
    errors = sorted(validator.iter_errors(payload), key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return
    field, what = _describe(errors[0])
    subject = f"payload field {field!r}" if field else "payload"
    raise PayloadError(field, f"{subject} {what} ({whose}; its schema is {where}, which `streamrft schemas "
                              "--payloads` prints)")


def _describe(error) -> tuple[str, str]:
    """(the key at fault, what is wrong with it) of a validation error."""
    path = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "required":
        missing = [key for key in error.validator_value if key not in error.instance]
        key = ".".join(filter(None, (path, missing[0])))
        return key, "is missing"
    if error.validator == "anyOf" and all("required" in option for option in error.validator_value):
        options = [option["required"] for option in error.validator_value]
        first_missing = next(key for key in options[0] if key not in error.instance)
        needs = " or ".join(" and ".join(repr(key) for key in keys) for keys in options)
        return first_missing, f"is missing: the payload needs {needs}"
    return path, f"is invalid: {error.message}"


def payload_schemas() -> dict[str, dict[str, dict]]:
    """``{"workflows": {name: schema}, "rewards": {name: schema}}``: every published payload schema."""
    return {"workflows": {name: _validator(workflow_schema_path(name)).schema for name in published_workflows()},
            "rewards": {name: _validator(reward_schema_path(name)).schema for name in published_rewards()}}
