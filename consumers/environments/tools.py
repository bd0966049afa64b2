"""Tool calls in the chat template's tool format, for tool environments.

Format (Hermes / Qwen2.5 / Qwen3, the format their chat templates render and parse): the
tools are described in the system message as JSON schemas inside ``<tools></tools>``;
the model calls one by writing
``<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>``; the environment
answers with a ``tool`` message (a template without tool support renders it as a
``tool`` turn, e.g. ChatML's ``<|im_start|>tool``). Pure functions, no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments``, or ``error`` (what was wrong with the
    call's JSON, said back to the model)."""

    name: str | None
    arguments: dict
    error: str | None = None


def tool_schema(name: str, description: str, parameters: dict[str, tuple[str, str]]) -> dict:
    """A tool's JSON schema (OpenAI function format, as chat templates take ``tools=``).

    Args:
        parameters: ``{name: (JSON type, description)}``; all required.
    """
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t, "description": d}
                                      for k, (t, d) in parameters.items()},
                       "required": list(parameters)}}}


def tools_system_message(tools: list[dict], preamble: str = "") -> dict:
    """The system message that offers ``tools`` (the Hermes/Qwen wording)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return {"role": "system", "content": (
        f"{preamble}\n\n" if preamble else "") + (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')}


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of a model turn, in order (a call whose body
    is not ``{"name": str, "arguments": object}`` JSON comes back with ``error``)."""
    out = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(ToolCall(None, {}, f"the tool call is not JSON: {e.msg} at {e.pos}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(ToolCall(None, {}, 'a tool call needs {"name": str, "arguments": {...}}'))
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.append(ToolCall(call["name"], {}, "arguments must be a JSON object"))
            continue
        out.append(ToolCall(call["name"], args))
    return out


def tool_message(content: str) -> dict:
    """The environment's answer to a call."""
    return {"role": "tool", "content": content}
