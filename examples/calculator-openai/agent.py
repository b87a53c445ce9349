"""The calculator task as an agent program written against the OpenAI API (recipe examples/calculator-openai.yaml;
docs/how-to/openai-agents.md).

Plain Python with the official ``openai`` client and nothing of rlcore: the agent sends the problem with a
``calculator`` tool, runs the calls the model makes itself, sends the results back as tool messages and returns the
reward of the model's final answer. rlcore runs ``run`` once per sample with a client whose base URL is the policy
being trained, records every completion and trains on them with the reward returned.
"""

from __future__ import annotations

import ast
import json
import operator

import openai

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": 'Integers with + - * / // % and parentheses, e.g. "37*85".'}}}}}
MAX_TURNS = 3  # model turns; a trajectory still calling the tool at its last one scores 0
MAX_RESULT_CHARS = 64  # of a tool result the model reads

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(node: ast.AST) -> int | float:
    """The value of an arithmetic expression's syntax tree (nothing else is evaluated)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](calculate(node.left), calculate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](calculate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    value = calculate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def run_tool(call) -> str:
    """A tool call's result as the model reads it, or its error."""
    try:
        if call.function.name != "calculator":
            raise ValueError(f"unknown tool {call.function.name!r}")
        return calculator(**json.loads(call.function.arguments))[:MAX_RESULT_CHARS]
    except Exception as err:  # noqa: BLE001 - the model reads what went wrong
        return f"error: {err}"[:MAX_RESULT_CHARS]


async def run(client: openai.AsyncOpenAI, row: dict) -> dict:
    """One trajectory: ``row["messages"]`` is the problem's chat prompt, ``row["ground_truth"]`` its product."""
    messages = list(row["messages"])
    calls = 0
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            answer = (message.content or "").strip()
            correct = answer.isdigit() and int(answer) == int(row["ground_truth"])
            return {"score": float(correct), "tool_calls": calls}
        for call in message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return {"score": 0.0, "tool_calls": calls}
