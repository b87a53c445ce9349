"""Tool processes (rlcore.agents.tools, rlcore.agents.sandbox): the hostile tools of the issue (sleep forever, print
10 MB, raise, exit the process) and the sandbox limits each become an error observation of their kind, the pool goes
on with fresh processes, and a tool's schema comes from its type hints and docstring."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlcore.agents.spec import AgentSpec, ToolRef
from rlcore.agents.tools import ToolPool

TOOLS = str(Path(__file__).with_name("tools_for_tests.py"))
NAMES = ("add", "echo", "sleep_forever", "print_10mb", "raise_error", "exit_process", "connect", "allocate")


@pytest.fixture(scope="module")
def pool():
    p = ToolPool(AgentSpec(tools=tuple(ToolRef(TOOLS, n) for n in NAMES), timeout_s=1.0, memory_mb=512,
                           max_tool_response_chars=50, processes=2))
    yield p
    p.close()


def test_each_hostile_tool_is_an_error_observation_of_its_kind_and_the_pool_goes_on(pool):
    start = time.monotonic()
    futures = {name: pool.call(name, args) for name, args in [
        ("sleep_forever", {}), ("print_10mb", {}), ("raise_error", {"message": "no luck"}), ("exit_process", {}),
        ("connect", {}), ("allocate", {"megabytes": 4096}), ("add", {"a": 1, "c": 2})]}
    got = {name: f.result(timeout=60) for name, f in futures.items()}
    assert time.monotonic() - start < 30  # one timeout of 1 s, the rest at once; never a hang
    assert got["sleep_forever"].error == "timeout" and "1 s" in got["sleep_forever"].text
    big = got["print_10mb"]
    assert big.error == "oversized" and big.text.startswith("x" * 50) and "x" * 51 not in big.text
    assert f"{(10 << 20) + 1} characters, the limit is 50" in big.text  # print's newline counts
    assert got["raise_error"].error == "raised" and got["raise_error"].text == "error: ValueError: no luck"
    assert got["exit_process"].error == "exited" and "exited with code 7" in got["exit_process"].text
    assert got["connect"].error == "raised"  # no network in the sandbox
    assert got["allocate"].error == "raised" and "MemoryError" in got["allocate"].text  # 4 GiB past the 512 MiB limit
    assert got["add"].error == "bad_arguments" and "'c'" in got["add"].text
    assert pool.network in ("namespace", "python")
    # the processes killed for the timeout and the exit were replaced: calls work again, on both slots
    again = [pool.call("add", {"a": i, "b": 1}) for i in range(4)]
    assert [f.result(timeout=30).text for f in again] == ["1", "2", "3", "4"]
    assert [f.result().error for f in again] == [None] * 4


def test_a_timed_out_tool_is_killed_with_its_own_children(tmp_path):
    p = ToolPool(AgentSpec(tools=(ToolRef(TOOLS, "add"), ToolRef(TOOLS, "spawn_and_hang")), timeout_s=1.0,
                           processes=1))
    try:
        assert p.call("add", {"a": 2}).result(timeout=30).text == "2"
        tool_pid = p.slots[0].process.proc.pid
        pid_file = tmp_path / "child.pid"
        assert p.call("spawn_and_hang", {"pid_file": str(pid_file)}).result(timeout=30).error == "timeout"
        child_pid = int(pid_file.read_text())
        time.sleep(0.2)  # the child is reparented and reaped once killed
        assert not _running(tool_pid) and not _running(child_pid)
        assert p.call("add", {"a": 3}).result(timeout=30).text == "3"  # a fresh process
        assert p.starts == 2
    finally:
        p.close()


def test_calls_sent_together_are_each_answered_under_their_own_timeout():
    # one process: all five go in one write; the timeout and the exit each end the process, and the calls after
    # them are answered by a fresh one
    p = ToolPool(AgentSpec(tools=tuple(ToolRef(TOOLS, n) for n in ("add", "sleep_forever", "exit_process")),
                           timeout_s=1.0, processes=1))
    try:
        futures = p.calls([("add", {"a": 1}), ("sleep_forever", {}), ("add", {"a": 2}), ("exit_process", {}),
                           ("add", {"a": 3})])
        got = [f.result(timeout=60) for f in futures]
    finally:
        p.close()
    assert [r.error for r in got] == [None, "timeout", None, "exited", None]
    assert [got[i].text for i in (0, 2, 4)] == ["1", "2", "3"]
    assert p.starts == 3


def test_a_batch_larger_than_the_pipes_does_not_deadlock():
    # 600 requests of 2 KB and their 2 KB replies: far more than a pipe holds either way
    p = ToolPool(AgentSpec(tools=(ToolRef(TOOLS, "echo"),), max_tool_response_chars=4096, processes=1))
    try:
        futures = p.calls([("echo", {"text": f"{i:04d}" * 500}) for i in range(600)])
        texts = [f.result(timeout=120).text for f in futures]
    finally:
        p.close()
    assert texts == [f"{i:04d}" * 500 for i in range(600)]


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text().lower()


def test_schema_from_type_hints_and_docstring(pool):
    described = pool.describe()
    assert described["tools"]["add"] == {"kind": "function", "schema": {"type": "function", "function": {
        "name": "add", "description": "Add two integers.", "parameters": {
            "type": "object", "required": ["a"], "properties": {
                "a": {"type": "integer", "description": "The first."},
                "b": {"type": "integer", "description": "The second.", "default": 0}}}}}}


def test_broken_tool_definitions_are_reported_per_tool(tmp_path):
    spec = AgentSpec(tools=(ToolRef(TOOLS, "no_hints"), ToolRef(TOOLS, "missing"), ToolRef(str(tmp_path / "x.py"), "f"),
                            ToolRef(TOOLS, "Counter")))
    p = ToolPool(spec)
    try:
        d = p.describe()
    finally:
        p.close()
    assert d["tools"]["no_hints"] == {"kind": "error", "message": "tool no_hints: parameter 'a' has no type hint"}
    assert d["tools"]["Counter"]["kind"] == "environment"
    assert "has no 'missing'" in d["broken"]["missing"] and "add, allocate" in d["broken"]["missing"]
    assert "not found" in d["broken"]["f"]


def test_a_tool_file_that_opens_a_missing_file_while_importing_is_not_reported_as_missing(tmp_path):
    tool = tmp_path / "reads_a_table.py"
    tool.write_text("open('no_such_table.csv')\n\ndef f(a: int) -> int:\n    \"\"\"F.\"\"\"\n    return a\n")
    p = ToolPool(AgentSpec(tools=(ToolRef(str(tool), "f"),)))
    try:
        d = p.describe()
    finally:
        p.close()
    assert "no_such_table.csv" in d["broken"]["f"] and "tool file" not in d["broken"]["f"], d["broken"]["f"]


def test_closing_the_pool_kills_its_processes():
    p = ToolPool(AgentSpec(tools=(ToolRef(TOOLS, "add"),), processes=2))
    assert [p.call("add", {"a": 1}).result(timeout=30).text for _ in range(2)] == ["1", "1"]
    pids = [s.process.proc.pid for s in p.slots if s.process is not None]
    p.close()
    assert pids and not any(_running(pid) for pid in pids)
