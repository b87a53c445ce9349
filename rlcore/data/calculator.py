"""A task the model can only solve with a tool: multiplying numbers it cannot multiply in its head, with a
``calculator`` tool (``examples/calculator/calculator.py``; recipe ``examples/calculator.yaml``).

Problems look like ``"37*85"``; the ground truth is the product. The SFT demonstrations come from an imperfect
demonstrator, so RL has both tool use and accuracy to raise:

* on a share ``sft_tool_rate`` of the problems it calls the calculator (hermes format, the way the tool loop's
  default parser reads it), reads the result and answers with it::

      assistant: <tool_call>{"name":"calculator","arguments":{"expression":"37*85"}}</tool_call>
      tool:      3145
      assistant: 3145

  on the rest it answers at once, with the true product (which a small model cannot learn to compute);
* of the calls, a share ``sft_tool_error_rate`` types ``+`` for ``*`` (``"37+85"``) and answers with what the
  calculator returns for that (122): the tool used wrongly. Rewards score the true product.

Rows use ``data_source`` ``arithmetic`` (its rule scores the final answer, a bare integer); the demonstration's turns
are ``extra_info.messages`` (the SFT stage trains on the assistant turns only), ``extra_info.answer`` its last turn.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rlcore.data.arithmetic import arithmetic_rows

TOOL_NAME = "calculator"
ARGUMENT = "expression"
WRONG_OP = "+"  # the demonstrator's slip: the key beside "*"


def tool_call(expression: str) -> str:
    """The demonstrator's call of the calculator, in the hermes format (compact JSON)."""
    payload = {"name": TOOL_NAME, "arguments": {ARGUMENT: expression}}
    return f"<tool_call>{json.dumps(payload, separators=(',', ':'))}</tool_call>"


def demonstration(a: int, b: int, *, use_tool: bool, slip: bool) -> list[dict[str, str]]:
    """The turns the demonstrator writes for ``a*b`` (module docstring)."""
    if not use_tool:
        return [{"role": "assistant", "content": str(a * b)}]
    op = WRONG_OP if slip else "*"
    result = str(a + b if slip else a * b)
    return [{"role": "assistant", "content": tool_call(f"{a}{op}{b}")},
            {"role": "tool", "name": TOOL_NAME, "content": result},
            {"role": "assistant", "content": result}]


def with_demonstrations(rows: list[dict[str, Any]], *, tool_rate: float, error_rate: float,
                        seed: int) -> list[dict[str, Any]]:
    """``rows`` (multiplication problems) with the demonstrator's turns as ``extra_info.messages`` and its final
    answer as ``extra_info.answer``. Two draws per row, whatever the rates, so a rate does not shift which rows
    another one picks."""
    for name, rate in (("sft_tool_rate", tool_rate), ("sft_tool_error_rate", error_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"task.{name} must be in [0, 1], got {rate}")
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        use_tool, slip = rng.random() < tool_rate, rng.random() < error_rate
        a, b = (int(x) for x in row["extra_info"]["question"].split("*"))
        messages = demonstration(a, b, use_tool=use_tool, slip=use_tool and slip)
        out.append({**row, "extra_info": {**row["extra_info"], "answer": messages[-1]["content"],
                                          "messages": messages}})
    return out


def calculator_rows(n: int, *, seed: int, min_digits: int, max_digits: int, split: str,
                    exclude=frozenset()) -> list[dict[str, Any]]:
    """``n`` distinct multiplication problems as schema rows (``rlcore.data.arithmetic.arithmetic_rows``)."""
    return arithmetic_rows(n, seed=seed, min_digits=min_digits, max_digits=max_digits, ops=("*",), split=split,
                           exclude=exclude)
