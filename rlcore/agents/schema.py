"""A tool's OpenAI function schema from its signature: type hints give each parameter's JSON schema (pydantic),
the docstring gives the descriptions (Google, NumPy or reST style, read by ``docstring_parser``).

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: Integers with + - * / and parentheses, e.g. "37*85".
        '''

gives ``{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic
expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description":
"Integers with ..."}}, "required": ["expression"]}}}``: what ``tokenizer.apply_chat_template(..., tools=[...])``
and OpenAI's ``tools`` field take. A class with ``reset``, ``step`` and ``reward`` methods is an environment
instead (:mod:`rlcore.agents.loop`). Runs in the tool process (:mod:`rlcore.agents.sandbox`), which imported the
file.
"""

from __future__ import annotations

import inspect
import json
import typing
from typing import Any, Callable

ENVIRONMENT_METHODS = ("reset", "step", "reward")


class ToolDefinitionError(ValueError):
    """A tool whose schema cannot be made (no docstring, a parameter without a type hint, ``*args``)."""


def is_environment(obj: Any) -> bool:
    return inspect.isclass(obj) and all(callable(getattr(obj, m, None)) for m in ENVIRONMENT_METHODS)


def describe(obj: Any, name: str) -> dict:
    """``{"kind": "environment", "description"}`` for an environment class, ``{"kind": "function", "schema"}`` for
    a function, ``{"kind": "error", "message"}`` for anything else or a function without a usable signature."""
    if is_environment(obj):
        return {"kind": "environment", "description": (inspect.getdoc(obj) or "").split("\n\n")[0]}
    if inspect.isclass(obj):
        missing = [m for m in ENVIRONMENT_METHODS if not callable(getattr(obj, m, None))]
        return {"kind": "error", "message": f"{name} is a class without {', '.join(missing)}: an environment needs "
                                            f"{', '.join(ENVIRONMENT_METHODS)}"}
    if not callable(obj):
        return {"kind": "error", "message": f"{name} is a {type(obj).__name__}, not a function or a class"}
    try:
        return {"kind": "function", "schema": function_schema(obj, name)}
    except ToolDefinitionError as err:
        return {"kind": "error", "message": str(err)}


def function_schema(fn: Callable, name: str) -> dict:
    """The OpenAI function schema of ``fn`` (module docstring), named ``name``."""
    # loaded when a tool process is asked to describe its tools, not at every tool process's start
    import docstring_parser
    from pydantic import TypeAdapter
    from pydantic.errors import PydanticUserError

    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    description = "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)
    if not description:
        raise ToolDefinitionError(f"tool {name}: needs a docstring (its first line is the description the model reads)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # noqa: BLE001 - a hint naming something undefined
        raise ToolDefinitionError(f"tool {name}: its type hints do not resolve ({err})") from None
    args = {p.arg_name: p.description for p in doc.params}
    properties: dict[str, dict] = {}
    required, defs = [], {}
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {name}: *{pname} parameters cannot be described; name every argument")
        if pname not in hints:
            raise ToolDefinitionError(f"tool {name}: parameter {pname!r} has no type hint")
        try:
            schema = TypeAdapter(hints[pname]).json_schema()
        except PydanticUserError as err:
            raise ToolDefinitionError(f"tool {name}: parameter {pname!r}: {err}") from None
        defs.update(schema.pop("$defs", {}))
        if args.get(pname):
            schema["description"] = args[pname]
        if p.default is p.empty:
            required.append(pname)
        elif _jsonable(p.default):
            schema["default"] = p.default
        properties[pname] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if defs:
        parameters["$defs"] = defs
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
