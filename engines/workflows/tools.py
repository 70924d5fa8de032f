"""Tool use: an environment in which the model answers a question and may call tools on the way.

A tool call is a JSON function call, ``{"name": "calculator", "arguments": {"expression": "12 * 7"}}``, written
inside ``<tool_call>...</tool_call>`` (the format of the Hermes and Qwen chat templates; a reply that is only
such a JSON object counts too). The tool's result comes back as a ``tool`` message and the model takes another
turn. The first turn without a tool call is the answer: the episode ends there and is scored by the
environment's ``answer_reward`` (the task's ``reward_fn`` replaces it).

Per-step rewards: a turn whose call cannot be run (not JSON, an unknown tool, arguments the tool refuses) gets
``bad_call_reward`` (on that turn's last token, ``token_rewards``) and an error message the model can read.
Subclass :class:`ToolEnvironment` with your own ``tools`` and ``instructions`` to build another one.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .episode import Environment, Turn
from .registry import get_reward
from .rewards import Reward


class ToolError(ValueError):
    """A call the tool cannot run; the message goes back to the model."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, its JSON-schema parameters, and the function
    (keyword arguments in, text out; raise :class:`ToolError` to refuse)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function description shown to the model."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def find_tool_call(text: str) -> str | None:
    """The text of the tool call in a model turn, or None when the turn makes no call (it answers)."""
    tagged = _TAGGED.search(text)
    if tagged:
        return tagged.group(1)
    stripped = text.strip()
    if stripped.startswith("{") and '"name"' in stripped:
        return stripped
    return None


def parse_tool_call(call: str, tools: Mapping[str, Tool]) -> tuple[Tool, dict[str, Any]]:
    """The tool and arguments of a call's JSON; ToolError saying what is wrong with it otherwise."""
    try:
        data = json.loads(call)
    except json.JSONDecodeError as exc:
        raise ToolError(f"the tool call is not JSON ({exc.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ToolError('a tool call is {"name": ..., "arguments": {...}}')
    tool = tools.get(data["name"])
    if tool is None:
        raise ToolError(f"there is no tool named {data['name']!r}; the tools are {', '.join(sorted(tools))}")
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolError("the arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise ToolError("the arguments are not a JSON object")
    return tool, arguments


class ToolEnvironment(Environment):
    """A question (payload ``question``, reference ``answer``) answered with the help of ``tools``."""

    tools: ClassVar[Mapping[str, Tool]] = {}
    answer_reward: ClassVar[str] = "exact_number"
    bad_call_reward: ClassVar[float] = -0.1
    instructions: ClassVar[str] = (
        "You can call these tools:\n{tools}\nTo call one, reply with only <tool_call>{{\"name\": ..., "
        "\"arguments\": {{...}}}}</tool_call>. You will get its result. When you know the answer, reply with it "
        "and no tool call.{example}"
    )
    example: ClassVar[str] = ""  # a worked exchange appended to the instructions (small models need one)

    def __init__(self, payload) -> None:
        super().__init__(payload)
        if "question" not in payload:
            raise KeyError("the task payload has no 'question'")
        self.calls = 0
        self.bad_calls = 0
        self.answer: str | None = None

    def opening(self):
        tools = "\n".join(json.dumps(tool.schema()) for tool in self.tools.values())
        return [{"role": "system", "content": self.instructions.format(tools=tools, example=self.example)},
                {"role": "user", "content": str(self.payload["question"])}]

    def step(self, text: str) -> Turn:
        call = find_tool_call(text)
        if call is None:
            self.answer = text
            return Turn(done=True)
        self.calls += 1
        try:
            tool, arguments = parse_tool_call(call, self.tools)
            result = self.run_tool(tool, arguments)
        except ToolError as exc:
            self.bad_calls += 1
            return Turn([{"role": "tool", "content": f"Error: {exc}"}], reward=self.bad_call_reward)
        return Turn([{"role": "tool", "content": result}])

    @staticmethod
    def run_tool(tool: Tool, arguments: dict[str, Any]) -> str:
        try:
            return str(tool.function(**arguments))
        except ToolError:
            raise
        except TypeError as exc:  # missing or unexpected arguments
            raise ToolError(f"{tool.name}: {exc}") from None
        except (ArithmeticError, ValueError) as exc:  # what the call's values make a tool fail with
            raise ToolError(f"{tool.name}: {type(exc).__name__}: {exc}") from None

    def outcome(self) -> Reward:
        if self.answer is None:  # the budget ended the episode before an answer
            return Reward(0.0)
        return Reward.of(get_reward(self.answer_reward)(self.answer, self.payload))

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "bad_tool_calls": float(self.bad_calls),
                "answered": float(self.answer is not None)}
