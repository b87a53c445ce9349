"""The calculator tool of the built-in calculator task (examples/calculator.yaml; docs/how-to/tools.md).

A tool file is plain Python: each tool is a function with type hints and a docstring, which the tool loop turns
into the OpenAI function schema the chat template shows the model. It runs in a sandboxed tool process.
"""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_DIGITS = 100  # results longer than this are refused (an expression like 9**9**9 would never finish)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        result = _OPS[type(node.op)](_value(node.left), _value(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        result = _OPS[type(node.op)](_value(node.operand))
    else:
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (integers, + - * / // % and parentheses)")
    if isinstance(result, int) and len(str(abs(result))) > _MAX_DIGITS:
        raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
    return result


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Integers with + - * / // % and parentheses, e.g. "37*85".
    """
    value = _value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
