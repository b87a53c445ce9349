"""A worker's agent processes (:mod:`rlcore.agents.agent_process`): trajectories in, each one's result or the way it
failed out, whatever the agents do.

    pool = AgentPool(spec, socket_path)
    results = pool.run([{"id": 0, "token": ..., "row": {...}}, ...], done=lambda i: ...)
    pool.close()

Trajectory ``i`` runs in process ``i % processes`` (all of a call's trajectories at once, each process's in one
write). A process that dies (its agent called ``os._exit``, crashed, hit the memory limit in C code, or held the
loop past a time limit: the process ends itself and names the trajectory) ends the trajectories it held: the one it
named ``timeout``, the others ``exited`` (the process died under them) or ``lost`` (another trajectory's hold killed
it). One that runs :data:`GRACE_S` past its time limit without an answer (its agent swallows cancellation and never
yields) has its process killed: it is a ``timeout``, the others there ``lost``. The next call starts fresh
processes where they died. Nothing outlives the pool: :meth:`close` kills the processes' groups, and they die with
the thread that started them if the worker dies first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from rlcore.agents.sandbox import read_frame, write_frame
from rlcore.agents.spec import EndpointAgentSpec
from rlcore.agents.tools import close_at_exit

GRACE_S = 5.0
"""Seconds past a trajectory's time limit before its process is killed from outside."""
START_TIMEOUT_S = 120.0
_CHILD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from rlcore.agents.agent_process import main; main(sys.argv[2:])")


@dataclass
class AgentResult:
    """What one trajectory's agent gave: its return value (a number, a dict with ``score``, or None), or the kind of
    its failure and one line about it (``trace``: the agent's traceback, when it raised)."""

    value: Any = None
    failure: str | None = None
    text: str = ""
    trace: str = ""


class AgentStartError(RuntimeError):
    """An agent process that could not start or load the agent file (one line)."""


@dataclass
class _Process:
    proc: subprocess.Popen
    pending: dict[int, tuple[Callable[[AgentResult], None], float]] = field(default_factory=dict)  # id -> (resolve,
    # deadline)
    stuck: int | None = None
    killed_for: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class AgentPool:
    """The agent processes of one worker for one :class:`~rlcore.agents.spec.EndpointAgentSpec` (module docstring)."""

    def __init__(self, spec: EndpointAgentSpec, socket_path: str):
        self.spec, self.socket_path = spec, socket_path
        self.processes: list[_Process | None] = [None] * max(1, spec.processes)
        self.network: str | None = None
        self.starts = 0
        close_at_exit(self)

    def _start(self) -> _Process:
        """A new agent process, started (and then read) by a thread of its own: the process dies with the thread
        that started it (``PR_SET_PDEATHSIG``), so that thread lives as long as the process does."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def own() -> None:
            try:
                box["process"] = self._spawn()
            except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
                box["error"] = err
            finally:
                ready.set()
            if "process" in box:
                self._read(box["process"])

        threading.Thread(target=own, daemon=True, name="rlcore-agent-process").start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box["process"]

    def _spawn(self) -> _Process:
        settings = {"path": self.spec.agent.path, "name": self.spec.agent.name, "socket": self.socket_path,
                    "memory_mb": self.spec.memory_mb}
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path), json.dumps(settings)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        hello = _read_with_timeout(proc, START_TIMEOUT_S)
        if hello is None or not hello.get("ok"):
            _kill(proc)
            _close(proc)
            why = "did not start" if hello is None else hello.get("error", "failed")
            raise AgentStartError(f"rollout.agent.agents: the agent process {why}")
        self.network, self.starts = hello["network"], self.starts + 1
        return _Process(proc)

    def run(self, jobs: list[dict[str, Any]], done: Callable[[int], None] | None = None) -> list[AgentResult]:
        """Run every job (``{"id": i, "token", "row"}``, ids ``0..len-1``) and wait for all: each one's result, in
        order. ``done(i)`` is called (in a reader thread) as soon as trajectory ``i`` has its result."""
        results: list[Future] = [Future() for _ in jobs]

        def resolve(i: int, result: AgentResult) -> None:  # done(i) first: the caller wakes on the future
            if done is not None:
                done(i)
            results[i].set_result(result)

        for slot in range(len(self.processes)):
            mine = [j for j in jobs if j["id"] % len(self.processes) == slot]
            if mine:
                self._send(slot, mine, resolve)
        self._wait(results)
        return [f.result() for f in results]

    def _send(self, slot: int, jobs: list[dict[str, Any]], resolve: Callable[[int, AgentResult], None]) -> None:
        process = self.processes[slot]
        if process is None or process.proc.poll() is not None:
            process = self.processes[slot] = self._start()
        deadline = time.monotonic() + self.spec.timeout_s
        with process.lock:
            for j in jobs:
                process.pending[j["id"]] = (partial(resolve, j["id"]), deadline)
        assert process.proc.stdin is not None
        try:
            for j in jobs:
                write_frame(process.proc.stdin, {"op": "run", "timeout_s": self.spec.timeout_s, **j})
        except (BrokenPipeError, OSError):
            pass  # the process died: its reader resolves the jobs

    def _wait(self, results: list[Future]) -> None:
        """Wait for every result, killing a process whose trajectory overstays its time limit by GRACE_S."""
        pending = set(results)
        while pending:
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            now = time.monotonic()
            for process in self.processes:
                if process is None:
                    continue
                with process.lock:
                    late = [i for i, (_, deadline) in process.pending.items() if now > deadline + GRACE_S]
                if late and process.killed_for is None:
                    process.killed_for = late[0]
                    _kill(process.proc)

    def _read(self, process: _Process) -> None:
        """(A thread per process.) Hand each reply to its trajectory; when the process ends, end the rest."""
        assert process.proc.stdout is not None
        while (reply := read_frame(process.proc.stdout)) is not None:
            if "stuck" in reply:
                process.stuck = int(reply["stuck"])
                continue
            with process.lock:
                entry = process.pending.pop(int(reply["id"]), None)
            if entry is not None:
                ok = reply.get("ok")
                entry[0](AgentResult(value=reply.get("value")) if ok else AgentResult(
                    failure=reply.get("error", "raised"), text=reply.get("text", ""), trace=reply.get("trace", "")))
        code = process.proc.wait()
        _close(process.proc)
        with process.lock:
            left, process.pending = process.pending, {}
        blamed = process.stuck if process.stuck is not None else process.killed_for
        for i, (resolve, _) in left.items():
            if i == blamed:
                resolve(AgentResult(failure="timeout", text="the agent held its process past its time limit; the "
                                                            "process was ended"))
            elif blamed is not None:
                resolve(AgentResult(failure="lost", text="its process was ended for another trajectory that held it "
                                                         "past its time limit"))
            else:
                resolve(AgentResult(failure="exited", text=f"the agent process {_death(code)}"))

    def close(self) -> None:
        """Kill every process and wait for it (their reader threads end the trajectories still running)."""
        for process in self.processes:
            if process is not None:
                _kill(process.proc)
                process.proc.wait()
        self.processes = [None] * len(self.processes)


def _read_with_timeout(proc: subprocess.Popen, timeout_s: float) -> dict | None:
    """The process's first reply, or None if it ends or says nothing within ``timeout_s``."""
    out: list[dict | None] = [None]
    reader = threading.Thread(target=lambda: out.__setitem__(0, read_frame(proc.stdout)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0]


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process's group (the agent's own children too); its reader sees the end of its output."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _close(proc: subprocess.Popen) -> None:
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
