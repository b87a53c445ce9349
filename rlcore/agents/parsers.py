"""Tool-call parsers: a model turn's text -> the calls it makes, selected by ``rollout.agent.parser``.

A parser takes the text of one model turn (its end-of-turn token removed) and returns a :class:`ParsedTurn`: the
text outside the calls (``content``) and each call in order. A call it recognises as one but cannot read (bad
JSON, no name, arguments that are not an object) is returned with its ``error`` set: the loop answers it with an
error observation (kind ``malformed``) instead of dropping it.

``hermes`` (the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, as
Qwen2.5, Qwen3, Hermes and most chat templates that take ``tools`` write them. A ``<tool_call>`` that is never
closed is malformed too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from rlcore.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None
    """Why the call could not be read (then ``name`` and ``arguments`` are what could be)."""


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The turn's text outside its calls, stripped."""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Parser:
    """A call format: ``parse`` a turn's text, and ``format`` calls as the model writes them (how ``rlcore serve``
    shows a conversation's earlier calls to a chat template that does not render ``tool_calls`` itself)."""

    parse: Callable[[str], ParsedTurn]
    format: Callable[[list[ToolCall]], str]


PARSERS: Registry[Parser] = Registry("tool-call parser")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def read_call(payload: str) -> ToolCall:
    """A call from its JSON text ``{"name": str, "arguments": object}`` (``arguments`` may also be a JSON string of
    an object, as OpenAI sends it)."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, f"not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(obj, dict):
        return ToolCall("", {}, f"expected a JSON object with name and arguments, got {type(obj).__name__}")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, "the call has no \"name\" string")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, {}, "\"arguments\" is a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCall(name, {}, f"\"arguments\" should be an object, got {type(args).__name__}")
    return ToolCall(name, args)


def hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks (module docstring)."""
    calls = [read_call(m.group(1).strip()) for m in _HERMES_BLOCK.finditer(text)]
    rest = _HERMES_BLOCK.sub("", text)
    if _HERMES_OPEN in rest:
        calls.append(ToolCall("", {}, "<tool_call> is not closed by </tool_call>"))
        rest = rest[: rest.index(_HERMES_OPEN)]
    return ParsedTurn(rest.strip(), calls)


def hermes_format(calls: list[ToolCall]) -> str:
    return "".join(f"<tool_call>{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}</tool_call>"
                   for c in calls)


PARSERS.add("hermes", Parser(hermes, hermes_format))
