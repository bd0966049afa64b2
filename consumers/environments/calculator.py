"""The calculator tool environment: the model may call ``calculator(expression)`` (the
chat template's tool format, :mod:`.tools`) any number of times up to the turn budget,
then answers; the episode's reward is 1.0 when the last number of its answer equals the
prompt's label (numerically), else 0.0.

The expression is evaluated over its syntax tree, never with ``eval``: numbers, ``+ - *
/ // % **`` and parentheses only; exponents above :data:`MAX_EXPONENT` and expressions
longer than :data:`MAX_CHARS` are refused (said back to the model as the tool's answer).
"""

from __future__ import annotations

import ast
import operator
import re

from relax.consumers.environments.tools import (
    parse_tool_calls,
    tool_message,
    tool_schema,
    tools_system_message,
)

MAX_CHARS = 200
MAX_EXPONENT = 64
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

TOOL = tool_schema("calculator", "Evaluate an arithmetic expression (numbers, + - * / // % ** "
                   "and parentheses) and return its value.",
                   {"expression": ("string", "the expression, e.g. 47 + 77")})


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression.

    Raises:
        ValueError: anything but numbers and ``+ - * / // % **`` with parentheses, an
            exponent above MAX_EXPONENT, over MAX_CHARS characters, or a division by 0.
    """
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return float(_value(tree.body))


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} above {MAX_EXPONENT}")
        try:
            return _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def format_number(x: float) -> str:
    """``124.0`` -> ``124``; other floats with up to 10 significant digits."""
    return str(int(x)) if x == int(x) and abs(x) < 1e15 else f"{x:.10g}"


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas as thousands separators), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


class CalculatorEnv:
    """One episode with the calculator tool (see the module docstring).

    Args:
        system: text before the tool description in the system message.
    """

    def __init__(self, system: str = "You are a helpful assistant. Use the calculator tool "
                                      "for arithmetic, then give the final answer as a number."):
        self.system = system
        self.label: float | None = None
        self.calls = 0

    def reset(self, prompt_row: dict) -> list[dict]:
        """System message with the tool, then the prompt as the user's message."""
        self.label = last_number(prompt_row.get("label") or "")
        return [tools_system_message([TOOL], self.system),
                {"role": "user", "content": prompt_row["prompt"]}]

    def step(self, response_text: str):
        """A turn with tool calls gets their results (one ``tool`` message); a turn
        without one is the answer: done, reward 1.0 / 0.0."""
        calls = parse_tool_calls(response_text)
        if not calls:
            answer = last_number(response_text)
            ok = answer is not None and self.label is not None and abs(answer - self.label) < 1e-6
            return None, True, 1.0 if ok else 0.0
        results = []
        for c in calls:
            self.calls += 1
            if c.error:
                results.append(f"error: {c.error}")
            elif c.name != "calculator":
                results.append(f"error: unknown tool {c.name!r}; the tool is calculator")
            else:
                try:
                    results.append(format_number(evaluate(str(c.arguments.get("expression", "")))))
                except ValueError as e:
                    results.append(f"error: {e}")
        return tool_message("\n".join(results)), False, None
