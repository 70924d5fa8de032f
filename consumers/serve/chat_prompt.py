"""A chat request's prompt, through the model's chat template, and an answer's tool calls.

Messages: ``content`` is text or a list of text parts (joined; a part of another type is refused by its type);
an assistant turn may be ``tool_calls`` with no content, and ``tool`` messages carry their results (an agent
loop's history). Tools: a template that shows ``tools`` to the model (Hermes, Qwen, SmolLM3 ...) gets them as
the ``tools`` argument and the assistant turns' ``tool_calls`` as they are; for a template that does not (it
renders the same text with or without them, checked once per tokenizer), the project's tool-call format is used,
as its tool workflows do (``engines/workflows/tools.py``): the tools are listed in a system message that asks for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and past calls are written that way into their
assistant turns. An answer is read in that format too: calls to tools of the request become ``tool_calls``
(OpenAI's, arguments as JSON text), the text before them the content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from streamrft.engines.inference import InferenceEngine
from streamrft.engines.workflows.tools import ToolEnvironment, find_tool_call

from .api_models import ChatRequest, Message
from .errors import error

_CLOSED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PROBE = "streamrft_probe_function"  # a name no template writes unless it renders what it is given


def _text(message: Message, index: int) -> str | None:
    if not isinstance(message.content, list):
        return message.content
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise error(400, f"messages[{index}].content[{j}]: a part of type {part.type!r}; this server reads "
                             "text parts only ({\"type\": \"text\", \"text\": ...})",
                        param=f"messages[{index}].content[{j}].type", code="invalid_value")
    return "".join(part.text for part in message.content)


class ChatPrompts:
    """Renders chat requests for one engine's tokenizer (what its template knows is found out once)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._knows: dict[str, bool] = {}

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The prompt's token ids; 400 for messages the template cannot take (HTTPException)."""
        messages = self.messages(request)
        tools = [t.function.model_dump(exclude_none=True) for t in request.tools or []]
        shown = [{"type": "function", "function": t} for t in tools]
        if shown and not self._knows_tools():
            messages = _with_instructions(messages, shown)
            shown = []
        text = self.engine.render_chat(messages, tools=shown or None)
        return self.engine.encode(text)

    def messages(self, request: ChatRequest) -> list[dict[str, Any]]:
        out = []
        for i, message in enumerate(request.messages):
            content = _text(message, i)
            if content is None and not (message.role == "assistant" and message.tool_calls):
                raise error(400, f"messages[{i}].content: null only for an assistant turn with tool_calls; "
                                 "allowed: a string or a list of text parts", param=f"messages[{i}].content",
                            code="invalid_value")
            entry: dict[str, Any] = {"role": message.role, "content": content or ""}
            if message.tool_calls:
                calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                         for c in message.tool_calls]
                if self._knows_tool_calls():
                    entry["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                           for c, call in zip(message.tool_calls, calls)]
                else:
                    entry["content"] += "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)
            if message.tool_call_id is not None and self._knows_tool_calls():
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
            out.append(entry)
        return out

    def _knows_tools(self) -> bool:
        if "tools" not in self._knows:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}
            self._knows["tools"] = self._renders(probe, tools=[tool])
        return self._knows["tools"]

    def _knows_tool_calls(self) -> bool:
        if "tool_calls" not in self._knows:
            call = {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
            self._knows["tool_calls"] = self._renders(probe)
        return self._knows["tool_calls"]

    def _renders(self, messages: list[dict], tools: list[dict] | None = None) -> bool:
        try:
            return _PROBE in self.engine.render_chat(messages, add_generation_prompt=False, tools=tools)
        except Exception:  # noqa: BLE001 - a template that refuses what it does not know does not know it
            return False


def _arguments(text: str) -> Any:
    """A call's arguments as the templates want them (an object); text that is no JSON stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _with_instructions(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    listing = ToolEnvironment.instructions.format(tools="\n".join(json.dumps(t) for t in tools), example="")
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{listing}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]


@dataclass(frozen=True)
class Calls:
    content: str | None
    tool_calls: list[dict[str, Any]]


class ToolAnswer:
    """Reads an answer's calls to the request's tools (``tool_choice`` none: the answer is text)."""

    def __init__(self, request: ChatRequest) -> None:
        choice = request.tool_choice
        self.names = {t.function.name for t in request.tools or []}
        if not isinstance(choice, str) and choice is not None:
            self.names = {choice.function.name}
        self.enabled = bool(request.tools) and choice != "none"

    def calls(self, text: str) -> Calls | None:
        if not self.enabled:
            return None
        found = _CLOSED_CALL.findall(text)
        if not found:
            single = find_tool_call(text)
            found = [single] if single is not None else []
        calls = [call for call in (self._call(raw) for raw in found) if call is not None]
        if not calls:
            return None
        before = text.split("<tool_call>", 1)[0].strip() if "<tool_call>" in text else ""
        return Calls(before or None, calls)

    def _call(self, raw: str) -> dict[str, Any] | None:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or data.get("name") not in self.names:
            return None
        arguments = data.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": data["name"], "arguments": text}}

    def required_schema(self, request: ChatRequest) -> dict[str, Any] | None:
        """The JSON schema a call must match when ``tool_choice`` requires one (guided decoding), else None."""
        choice = request.tool_choice
        if choice is None or choice in ("none", "auto") or not request.tools:
            return None
        functions = [t.function for t in request.tools if t.function.name in self.names]
        variants = [{"type": "object", "properties": {"name": {"const": f.name},
                                                      "arguments": f.parameters or {"type": "object"}},
                     "required": ["name", "arguments"]} for f in functions]
        return variants[0] if len(variants) == 1 else {"anyOf": variants}
