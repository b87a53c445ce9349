"""The line protocol between ``bench.run_bench`` (parent) and one system's process (child).

The parent writes commands on the child's stdin (``run K``, ``probe N`` (ours only), ``quit``); the child answers
on stdout with lines starting with ``@@bench `` followed by JSON. Anything else a child
prints (Ray, transformers, TRL) is only logged by the parent.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MARK = "@@bench "


def emit(kind: str, **data: Any) -> None:
    """Child side: send one record to the parent."""
    sys.stdout.write(MARK + json.dumps({"kind": kind, **data}) + "\n")
    sys.stdout.flush()


def next_command() -> tuple[str, int]:
    """Child side: block until the parent sends ``VERB N`` (-> (VERB, N)) or ``quit`` / EOF."""
    line = sys.stdin.readline()
    if not line or line.strip() == "quit":
        return "quit", 0
    verb, arg = line.split()
    return verb, int(arg)


def parse(line: str) -> dict[str, Any] | None:
    """Parent side: the record in a child's stdout line, or None for ordinary output."""
    return json.loads(line[len(MARK):]) if line.startswith(MARK) else None
