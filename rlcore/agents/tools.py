"""Tool calls run in sandboxed processes (:mod:`rlcore.agents.sandbox`), and every way a call can fail is an
observation with an error kind, never an exception in the worker or a hang.

    pool = ToolPool(spec)                      # spec: an AgentSpec; processes start on first use (start=True: now)
    future = pool.call("calculator", {"expression": "37*85"})
    result = future.result()                   # ToolResult(text="3145", error=None)

The pool has ``spec.processes`` slots, each a thread that owns one tool process. Calls wait in the pool's queue; a
free slot takes its share of them (the queue divided by the slots, at least one) and sends them in one write, and
the process answers each in turn (``pool.calls`` queues a whole turn's calls at once, so a turn of 256 calls on 2
processes costs a few round trips, not 256). An environment's requests go to the slot its key names, so its state
stays in one process. Each call's timeout runs from the moment the process starts on it (as the worker sees it: the
request sent, or the previous reply in; so never less than the timeout): past it, the process group is SIGKILLed (a
Python loop, C code, a ``sleep``, the tool's own children), and the calls sent after it go to a fresh process. Error kinds (:data:`ERROR_KINDS`): ``timeout``; ``exited`` (the process died: ``os._exit``, a
crash, the memory limit hit in C); ``raised`` (the tool raised, ``MemoryError`` included); ``bad_arguments`` (they
do not fit its signature); ``oversized`` (more than ``max_tool_response_chars``: the observation is the first that
many characters and a note); ``env_lost`` (an environment whose process was replaced); and, from the loop,
``malformed`` and ``unknown_tool``.

Costs: a process starts in about 0.1 s (the interpreter, json, ctypes and the tool file); a call costs two pipe
messages, about 0.1 ms alone and a few microseconds in a batch, on top of the tool itself.
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
from typing import Any, Callable

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
    """One tool process and its pipes. Requests go out through a non-blocking pipe while replies are read, so a
    batch larger than the pipe's buffer cannot deadlock the two sides."""

    def __init__(self, tools: list[dict], memory_mb: int):
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path), json.dumps(tools),
                                      str(memory_mb)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_child, self.from_child = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.to_child, False)
        self.unsent = b""  # requests not yet taken by the pipe
        self.received = bytearray()  # replies read but not yet handed out
        self.hello = self.receive(time.monotonic() + SETUP_TIMEOUT_S)

    def send(self, messages: list[dict]) -> None:
        """Queue ``messages`` (each a frame), written while :meth:`receive` waits."""
        frames = [json.dumps(m, ensure_ascii=False, default=str).encode() for m in messages]
        self.unsent += b"".join(HEADER.pack(len(f)) + f for f in frames)

    def receive(self, deadline: float) -> dict | None:
        """The next reply; None when the process ended; raises :class:`_Deadline`."""
        while True:
            if len(self.received) >= HEADER.size:
                (size,) = HEADER.unpack_from(self.received)
                if len(self.received) >= HEADER.size + size:
                    body = bytes(self.received[HEADER.size:HEADER.size + size])
                    del self.received[:HEADER.size + size]
                    return json.loads(body)
            left = deadline - time.monotonic()
            readable, writable, _ = select.select([self.from_child], [self.to_child] if self.unsent else [], [],
                                                  max(left, 0))
            if not readable and not writable:
                raise _Deadline()
            if writable:
                try:
                    self.unsent = self.unsent[os.write(self.to_child, self.unsent):]
                except BlockingIOError:
                    pass
                except OSError:  # the process is gone: what it wrote before is still read, then end of file
                    self.unsent = b""
            if readable:
                chunk = os.read(self.from_child, 1 << 16)
                if not chunk:
                    return None
                self.received += chunk

    def ready(self) -> bool:
        """A reply (or part of one) has come in and not been read."""
        return len(self.received) > 0 or bool(select.select([self.from_child], [], [], 0)[0])

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
    convert: Callable[[dict], Any] | None = None  # the reply as the future's value (None: the reply dict)

    def answer(self, reply: dict) -> None:
        try:
            self.future.set_result(reply if self.convert is None else self.convert(reply))
        except BaseException as err:  # noqa: BLE001 - the caller sees it, not the slot's thread
            self.future.set_exception(err)


class _Slot:
    """A thread that owns one tool process (started on the first job, and again after a kill or a death); it runs
    the jobs addressed to it first, then its share of the pool's shared ones, each group in one write."""

    def __init__(self, pool: ToolPool, index: int):
        self.pool, self.index = pool, index
        self.own: deque[_Job] = deque()
        self.process: _Process | None = None
        # the thread that starts a process must outlive it: PR_SET_PDEATHSIG fires when that thread ends
        self.thread = threading.Thread(target=self._serve, name=f"rlcore-tool-{index}", daemon=True)
        self.thread.start()

    def _next(self) -> list[_Job] | None:
        with self.pool.ready:
            while not (self.own or self.pool.shared or self.pool.closed):
                self.pool.ready.wait()
            if self.pool.closed:
                return None
            if self.own:
                jobs, self.own = list(self.own), deque()
                return jobs
            shared = self.pool.shared
            return [shared.popleft() for _ in range(-(-len(shared) // len(self.pool.slots)))]

    def _serve(self) -> None:
        if self.pool.start_now:
            self._start()  # a failure is reported to the first job, which tries again
        while (jobs := self._next()) is not None:
            try:
                self._execute(list(jobs))
            except BaseException as err:  # noqa: BLE001 - a bug here must not leave the loop waiting forever
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(err)
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

    def _execute(self, jobs: list[_Job]) -> None:
        """Answer ``jobs`` in order: all sent at once, each reply awaited under its own timeout. The job a process
        dies or times out on gets that error; the ones after it go to a fresh process."""
        while jobs:
            if self.pool.closed:
                raise RuntimeError("the tool pool was closed")
            failed = self._start()
            if failed:
                jobs.pop(0).answer({"ok": False, "error": "exited", "text": failed})
                continue
            assert self.process is not None
            self.process.send([j.request for j in jobs])
            answered: list[tuple[_Job, dict]] = []  # replies in hand, handed out together once none is waiting
            while jobs:
                job = jobs.pop(0)
                try:
                    reply = self.process.receive(time.monotonic() + job.timeout_s)
                except _Deadline:
                    self.stop()
                    reply = {"ok": False, "error": "timeout",
                             "text": f"no result within {job.timeout_s:g} s; the tool was stopped"}
                if reply is None:
                    process, self.process = self.process, None
                    process.kill()
                    reply = {"ok": False, "error": "exited", "text": f"the tool process {_death(process.proc.returncode)}"}
                answered.append((job, reply))
                if self.process is None or not jobs or not self.process.ready():
                    for j, r in answered:
                        j.answer(r)
                    answered = []
                if self.process is None:
                    break

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None


_POOLS: weakref.WeakSet = weakref.WeakSet()  # the open process pools of this process: tool and agent pools


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def close_at_exit(pool) -> None:
    """``pool.close()`` when this process exits, if ``pool`` is still there then (its processes must not outlive
    the worker)."""
    _POOLS.add(pool)


class ToolPool:
    """The tool processes of one worker for one :class:`~rlcore.agents.spec.AgentSpec` (module docstring)."""

    def __init__(self, spec: AgentSpec, *, start: bool = False):
        """``start``: start every slot's process now (in its thread), not at its first job: the first calls of a
        rollout then find warm processes whichever slot takes them."""
        self.spec, self.start_now = spec, start
        self.tool_list = [t.as_dict() for t in spec.tools]
        self.network: str | None = None  # "namespace" or "python", once a process has started
        self.starts = 0  # processes started (the first ones, and after every kill or death)
        self.ready = threading.Condition()
        self.shared: deque[_Job] = deque()
        self.closed = False
        self.slots = [_Slot(self, i) for i in range(max(1, spec.processes))]
        close_at_exit(self)

    def submit(self, request: dict, *, slot: int | None = None, timeout_s: float | None = None) -> Future:
        """Run ``request`` on ``slot``, or on the first free one; a future of the process's reply dict."""
        return self._queue([_Job(request, self.spec.timeout_s if timeout_s is None else timeout_s, Future())],
                           None if slot is None else [slot])[0]

    def _queue(self, jobs: list[_Job], slots: list[int] | None = None) -> list[Future]:
        """Queue ``jobs`` for any slot, or each for the slot ``slots`` names (modulo the slots: an environment's
        key), and wake the slots' threads; their futures."""
        if slots is not None and len(slots) != len(jobs):
            raise ValueError(f"{len(jobs)} jobs but {len(slots)} slots")
        with self.ready:
            if self.closed:
                raise RuntimeError("the tool pool is closed")
            if slots is None:
                self.shared.extend(jobs)
            else:
                for slot, job in zip(slots, jobs):
                    self.slots[slot % len(self.slots)].own.append(job)
            self.ready.notify_all()
        return [j.future for j in jobs]

    def call(self, name: str, args: dict[str, Any]) -> Future:
        """Call tool function ``name`` with keyword ``args``: a future of its :class:`ToolResult`."""
        return self.calls([(name, args)])[0]

    def calls(self, calls: list[tuple[str, dict[str, Any]]]) -> list[Future]:
        """:meth:`call` for each ``(name, args)``, queued at once (the slots split them between them)."""
        return self._queue([_Job({"op": "call", "name": name, "args": args,
                                  "max_chars": self.spec.max_tool_response_chars}, self.spec.timeout_s, Future(),
                                 self.result) for name, args in calls])

    def environment(self, op: str, key: int, **fields: Any) -> Future:
        """``reset`` (``name``, ``row``), ``step`` (``action``), ``reward`` or ``close`` the environment held
        under ``key``, in the process its key names: a future of its :class:`ToolResult`."""
        return self.environments(op, [(key, fields)])[0]

    def environments(self, op: str, requests: list[tuple[int, dict[str, Any]]]) -> list[Future]:
        """:meth:`environment` ``op`` for each ``(key, fields)``, queued at once."""
        return self._queue([_Job({"op": op, "env": str(key), "max_chars": self.spec.max_tool_response_chars, **fields},
                                 self.spec.timeout_s, Future(), self.result) for key, fields in requests],
                           [key for key, _ in requests])

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

