"""Tool calls run in sandboxed processes (:mod:`rlcore.agents.sandbox`), and every way a call can fail is an
observation with an error kind, never an exception in the worker or a hang.

    pool = ToolPool(spec)                      # spec: an AgentSpec; processes start on first use
    future = pool.call("calculator", {"expression": "37*85"})
    result = future.result()                   # ToolResult(text="3145", error=None)

The pool has ``spec.processes`` slots, each a thread that owns one tool process and runs one job at a time. A call
waits in the pool's queue for the first free slot (so no call waits behind a slow one while a process is free); an
environment's requests go to the slot its key names, so its state stays in one process. The call's timeout runs from the moment the request reaches the process: past it, the
process group is SIGKILLed (a Python loop, C code, a ``sleep``, the tool's own children) and the next job starts
a fresh process. Error kinds (:data:`ERROR_KINDS`): ``timeout``; ``exited`` (the process died: ``os._exit``, a
crash, the memory limit hit in C); ``raised`` (the tool raised, ``MemoryError`` included); ``bad_arguments`` (they
do not fit its signature); ``oversized`` (more than ``max_tool_response_chars``: the observation is the first that
many characters and a note); ``env_lost`` (an environment whose process was replaced); and, from the loop,
``malformed`` and ``unknown_tool``.

Costs: a process starts in about 0.1 s (the interpreter, json, ctypes and the tool file); a call costs two pipe
messages, about 0.1 ms, on top of the tool itself.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rlcore.agents.sandbox import HEADER
from rlcore.agents.spec import AgentSpec

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "oversized", "exited", "env_lost")
SETUP_TIMEOUT_S = 60.0  # a tool process's start and its import of the tool files
_CHILD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from rlcore.agents.sandbox import main; main(sys.argv[2:])")


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the observation text, the error kind (None: it worked), and for an environment's step
    its reward and whether the episode is over."""

    text: str
    error: str | None = None
    reward: float | None = None
    done: bool = False


class _Deadline(Exception):
    pass


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``fd`` before ``deadline`` (monotonic); None at end of file; raises :class:`_Deadline`."""
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise _Deadline()
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _death(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Process:
    """One tool process and its pipes."""

    def __init__(self, tools: list[dict], memory_mb: int):
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path), json.dumps(tools),
                                      str(memory_mb)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.hello = self.receive(time.monotonic() + SETUP_TIMEOUT_S)

    def send(self, message: dict) -> None:
        data = json.dumps(message, ensure_ascii=False, default=str).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict | None:
        """The next reply; None when the process ended; raises :class:`_Deadline`."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        head = _read_exact(fd, HEADER.size, deadline)
        if head is None:
            return None
        body = _read_exact(fd, HEADER.unpack(head)[0], deadline)
        return None if body is None else json.loads(body)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the tool's own children too
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@dataclass
class _Job:
    request: dict
    timeout_s: float
    future: Future


class _Slot:
    """A thread that owns one tool process (started on the first job, and again after a kill or a death); it runs
    the jobs addressed to it first, then the pool's shared ones."""

    def __init__(self, pool: ToolPool, index: int):
        self.pool, self.index = pool, index
        self.own: deque[_Job] = deque()
        self.process: _Process | None = None
        # the thread that starts a process must outlive it: PR_SET_PDEATHSIG fires when that thread ends
        self.thread = threading.Thread(target=self._serve, name=f"rlcore-tool-{index}", daemon=True)
        self.thread.start()

    def _next(self) -> _Job | None:
        with self.pool.ready:
            while not (self.own or self.pool.shared or self.pool.closed):
                self.pool.ready.wait()
            if self.pool.closed:
                return None
            return self.own.popleft() if self.own else self.pool.shared.popleft()

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            try:
                result = self._execute(job.request, job.timeout_s)
            except BaseException as err:  # noqa: BLE001 - a bug here must not leave the loop waiting forever
                job.future.set_exception(err)
            else:
                job.future.set_result(result)
        self.stop()

    def _start(self) -> str | None:
        """Start the process if there is none; the reason it could not start, else None."""
        if self.process is not None:
            return None
        try:
            process = _Process(self.pool.tool_list, self.pool.spec.memory_mb)
        except _Deadline:
            return f"the tool process did not start within {SETUP_TIMEOUT_S:g} s (a tool file that hangs on import?)"
        if process.hello is None:
            code = process.proc.wait()
            return f"the tool process {_death(code)} while starting"
        self.process = process
        self.pool.network = process.hello["network"]
        self.pool.starts += 1
        return None

    def _execute(self, request: dict, timeout_s: float) -> dict:
        failed = self._start()
        if failed:
            return {"ok": False, "error": "exited", "text": failed}
        assert self.process is not None
        try:
            self.process.send(request)
            reply = self.process.receive(time.monotonic() + timeout_s)
        except _Deadline:
            self.stop()
            return {"ok": False, "error": "timeout", "text": f"no result within {timeout_s:g} s; the tool was stopped"}
        except (BrokenPipeError, OSError):
            reply = None
        if reply is None:
            process, self.process = self.process, None
            process.kill()
            return {"ok": False, "error": "exited", "text": f"the tool process {_death(process.proc.returncode)}"}
        return reply

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None


_POOLS: weakref.WeakSet[ToolPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


class ToolPool:
    """The tool processes of one worker for one :class:`~rlcore.agents.spec.AgentSpec` (module docstring)."""

    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.tool_list = [t.as_dict() for t in spec.tools]
        self.network: str | None = None  # "namespace" or "python", once a process has started
        self.starts = 0  # processes started (the first ones, and after every kill or death)
        self.ready = threading.Condition()
        self.shared: deque[_Job] = deque()
        self.closed = False
        self.slots = [_Slot(self, i) for i in range(max(1, spec.processes))]
        _POOLS.add(self)

    def submit(self, request: dict, *, slot: int | None = None, timeout_s: float | None = None) -> Future:
        """Run ``request`` on ``slot``, or on the first free one; a future of the process's reply dict."""
        future: Future = Future()
        job = _Job(request, self.spec.timeout_s if timeout_s is None else timeout_s, future)
        with self.ready:
            if self.closed:
                raise RuntimeError("the tool pool is closed")
            (self.slots[slot % len(self.slots)].own if slot is not None else self.shared).append(job)
            self.ready.notify_all()
        return future

    def call(self, name: str, args: dict[str, Any]) -> Future:
        """Call tool function ``name`` with keyword ``args``: a future of its :class:`ToolResult`."""
        return _then(self.submit({"op": "call", "name": name, "args": args,
                                  "max_chars": self.spec.max_tool_response_chars}), self.result)

    def environment(self, op: str, key: int, **fields: Any) -> Future:
        """``reset`` (``name``, ``row``), ``step`` (``action``), ``reward`` or ``close`` the environment held
        under ``key``, in the process its key names: a future of its :class:`ToolResult`."""
        request = {"op": op, "env": str(key), "max_chars": self.spec.max_tool_response_chars, **fields}
        return _then(self.submit(request, slot=key), self.result)

    def describe(self) -> dict:
        """What each tool is (``{"tools": {name: {"kind", ...}}, "broken": {name: why}}``), from a tool process."""
        reply = self.submit({"op": "describe"}, slot=0, timeout_s=SETUP_TIMEOUT_S).result()
        if not reply.get("ok"):
            raise RuntimeError(f"describing the tools failed: {reply.get('text')}")
        return reply

    def result(self, reply: dict) -> ToolResult:
        """A process's reply as a :class:`ToolResult` (an output past the limit cut and marked ``oversized``)."""
        if not reply.get("ok"):
            return ToolResult(f"error: {reply.get('text', '')}", reply.get("error", "raised"))
        text, limit = reply.get("text", ""), self.spec.max_tool_response_chars
        if reply.get("chars", 0) > limit:
            note = f"\n[error: output cut: {reply['chars']} characters, the limit is {limit}]"
            return ToolResult(text[:limit] + note, "oversized", reply.get("reward"), bool(reply.get("done")))
        return ToolResult(text, None, reply.get("reward"), bool(reply.get("done")))

    def close(self) -> None:
        """Stop every slot's thread and kill its process (also at exit); jobs not started fail."""
        with self.ready:
            self.closed = True
            left = list(self.shared) + [j for s in self.slots for j in s.own]
            self.shared.clear()
            for s in self.slots:
                s.own.clear()
            self.ready.notify_all()
        for job in left:
            job.future.set_exception(RuntimeError("the tool pool was closed"))
        for s in self.slots:
            s.stop()  # a job still running ends at once (its pipe closes)
            s.thread.join(timeout=5)


def _then(future: Future, fn) -> Future:
    """A future of ``fn(future.result())``."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as err:  # noqa: BLE001
            out.set_exception(err)

    future.add_done_callback(done)
    return out
