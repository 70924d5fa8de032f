"""``calculator``: arithmetic word problems answered with a calculator tool (:mod:`.tools`).

Payload ``{"question": "...", "answer": 84}``; :func:`streamrft.engines.tasks.make_word_problems` writes such
tasks. The tool evaluates ``+ - * / // % **`` and parentheses over integers and decimals exactly (fractions),
with no names, calls or attributes: it parses the expression, it never ``eval``s it. Sizes are bounded (the
expression's length, exponents, the digits of a number or a result) so a call cannot hold the worker. Whatever
goes wrong with a call (a bad expression, division by zero, a number that is not finite or too large) is a
:class:`~.tools.ToolError`: the model reads why and the call gets the bad-call penalty; the episode goes on.
"""
from __future__ import annotations

import ast
import math
import operator
from decimal import Decimal, localcontext
from fractions import Fraction

from .registry import register_environment
from .tools import Tool, ToolEnvironment, ToolError

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 60

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ToolError for anything else."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise ToolError(f"numbers must be finite; {node.value} is not")
        return _bounded(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ToolError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (ArithmeticError, ValueError) as exc:  # overflow and the like: the call's numbers, not the worker
            raise ToolError(f"cannot compute it: {exc}") from None
        return _bounded(Fraction(result))
    raise ToolError("only numbers, + - * / // % ** and parentheses are allowed")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_RESULT_DIGITS:
        raise ToolError(f"numbers and results have at most {MAX_RESULT_DIGITS} digits")
    return value


def format_number(value: Fraction) -> str:
    """Whole numbers as integers, others as decimals rounded to at most 6 places (exactly: no float)."""
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as context:
        context.prec = 2 * MAX_RESULT_DIGITS + 10
        rounded = (Decimal(value.numerator) / Decimal(value.denominator)).quantize(Decimal("0.000001"))
        text = format(rounded if rounded else Decimal(0), "f")  # no "-0" for a tiny negative value
    return text.rstrip("0").rstrip(".") if "." in text else text


def calculate(expression: str) -> str:
    return format_number(evaluate(expression))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluates an arithmetic expression (+ - * / // % ** and parentheses) exactly.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    function=calculate,
)


@register_environment("calculator")
class Calculator(ToolEnvironment):
    tools = {CALCULATOR.name: CALCULATOR}
    example = ('\nFor example, to the question "How much are 12 boxes of 34 pens and 5 more pens?" you reply '
               '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34 + 5"}}</tool_call>, the '
               'tool says 413, and you reply "The answer is 413."')
