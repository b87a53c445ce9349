"""The agent process: where the user's agent function runs, many trajectories at once on one asyncio loop, guarded as
tool processes are (:mod:`rlcore.agents.sandbox`).

A process is ``python -c`` with the worker's ``sys.path``. Before it imports the agent file it asks to die with the
thread that started it, points file descriptors 1 and 2 at ``/dev/null`` (its replies go through a copy of its
stdout), leaves the network (a new user and network namespace: no interface but a loopback that is down) and caps
its address space. The one thing it can reach is the endpoint's Unix socket, a file, which no network namespace
hides: each trajectory's client is ``openai.AsyncOpenAI`` with ``base_url`` ``http://rlcore/t/<token>/v1`` over that
socket, no retries (a retried request would be sampled twice), and the trajectory's time limit as its timeout.

Requests (framed JSON on stdin): ``{"op": "run", "id", "token", "row", "timeout_s"}``. Replies: the hello
``{"ok", "network", "error"}`` once the agent file is loaded, then per trajectory ``{"id", "ok": true, "value"}``
(the return value, checked: a number, ``{"score": number, ...}`` or None) or ``{"id", "ok": false, "error": kind,
"text", "trace"}`` with kind ``raised``, ``timeout`` (cancelled at its time limit) or ``bad_return``; and
``{"stuck": id}`` when a trajectory past its time limit holds the loop (it never yields: ``time.sleep``, a CPU
loop), just before the process ends itself (the worker counts that trajectory ``timeout`` and the others the
process held ``lost``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Any

import httpx2
import openai

from rlcore.agents.event_loop import new_event_loop
from rlcore.agents.sandbox import _one_line, enter_sandbox, read_frame, write_frame
from rlcore.inputs import MissingUserObject, load_user_object

STALL_CHECK_S = 0.25
"""How often the watchdog thread looks at the loop."""


def load_agent(path: str, name: str):
    """The agent function ``name`` of the file ``path``; ValueError (one line) when it is missing or not an agent:
    an ``async def`` taking the client and the row (two positional parameters)."""
    try:
        fn = load_user_object(path, name, "agent", "rlcore_agent")
    except MissingUserObject as err:
        raise ValueError(str(err)) from None
    problem = signature_problem(fn)
    if problem:
        raise ValueError(f"agent {name!r} ({path}): {problem}")
    return fn


def signature_problem(fn: Any) -> str | None:
    """Why ``fn`` is not an agent function (None: it is): ``async def run(client, row)``."""
    if not inspect.iscoroutinefunction(fn):
        kind = "a class" if inspect.isclass(fn) else "a plain def" if inspect.isfunction(fn) else type(fn).__name__
        return f"expected an async function `async def {getattr(fn, '__name__', 'run')}(client, row)`, got {kind}"
    try:
        sig = inspect.signature(fn)
        sig.bind(None, None)
    except TypeError:
        return f"expected two parameters (client, row), its signature is {getattr(fn, '__name__', 'run')}{sig}"
    return None


def checked_value(value: Any) -> tuple[Any, str | None]:
    """The return value as a reply carries it, and why it is not a reward (None: it is): a finite number, a dict with
    a finite number under ``score`` (other keys kept as extras), or None."""
    if value is None:
        return None, None
    if isinstance(value, dict):
        score = value.get("score")
        if not _finite(score):
            return None, f"returned a dict whose 'score' is {score!r}; expected a finite number"
        try:
            return json.loads(json.dumps(value, default=str)), None
        except (TypeError, ValueError) as err:
            return None, f"returned a dict that is not JSON: {err}"
    if _finite(value):
        return float(value), None
    return None, f"returned {type(value).__name__} {str(value)[:60]!r}; expected a number, {{'score': ...}} or None"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Runner:
    """The process's loop: each trajectory a task named by its id, each with its own client."""

    def __init__(self, fn, socket_path: str, reply):
        self.fn, self.reply = fn, reply
        self.lock = threading.Lock()
        self.deadlines: dict[str, float] = {}
        self.socket_path = socket_path
        self.limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        # the requests go over a Unix socket as plain HTTP; one context for every transport, which would each load
        # the CA bundle (tens of ms) to make their own
        self.ssl_context = httpx2.create_ssl_context(verify=False)

    def http_client(self) -> httpx2.AsyncClient:
        """A trajectory's own connection pool: httpcore's pool scans all its connections at every request and
        response, so one pool shared by the process's hundred-odd concurrent trajectories cost a quarter of their
        client's time."""
        transport = httpx2.AsyncHTTPTransport(uds=self.socket_path, limits=self.limits, verify=self.ssl_context)
        return openai.DefaultAsyncHttpxClient(transport=transport)

    def send(self, message: dict) -> None:
        with self.lock:
            write_frame(self.reply, message)

    async def run(self, req: dict) -> None:
        timeout, key = float(req["timeout_s"]), str(req["id"])
        self.deadlines[key] = time.monotonic() + timeout
        http = self.http_client()
        client = openai.AsyncOpenAI(base_url=f"http://rlcore/t/{req['token']}/v1", api_key=req["token"],
                                    http_client=http, max_retries=0, timeout=timeout)
        try:
            try:
                value = await asyncio.wait_for(self.fn(client, req["row"]), timeout)
            finally:
                await http.aclose()
        except TimeoutError:
            reply = {"ok": False, "error": "timeout", "text": f"the agent ran past its {timeout:g} s"}
        except BaseException as err:  # noqa: BLE001 - every failure of user code is counted, the others go on
            reply = {"ok": False, "error": "raised", "text": _one_line(err), "trace": traceback.format_exc(limit=-6)}
        else:
            value, problem = checked_value(value)
            reply = {"ok": True, "value": value} if problem is None else \
                {"ok": False, "error": "bad_return", "text": problem}
        self.deadlines.pop(key, None)
        self.send({"id": req["id"], **reply})


def watch(loop: asyncio.AbstractEventLoop, runner: Runner) -> None:
    """(A thread.) End the process when a trajectory past its time limit holds the loop (module docstring)."""
    answered = threading.Event()
    while True:
        answered.clear()
        loop.call_soon_threadsafe(answered.set)
        if answered.wait(STALL_CHECK_S * 4):
            time.sleep(STALL_CHECK_S)
            continue
        task = asyncio.current_task(loop)
        name = task.get_name() if task is not None else None
        if name in runner.deadlines and time.monotonic() > runner.deadlines[name]:
            runner.send({"stuck": int(name)})
            os._exit(3)


async def serve(fn, socket_path: str, requests, reply) -> None:
    """Run each request as a task until stdin closes."""
    loop = asyncio.get_running_loop()
    runner = Runner(fn, socket_path, reply)
    threading.Thread(target=watch, args=(loop, runner), daemon=True, name="rlcore-agent-watch").start()
    closed = loop.create_future()
    tasks: set[asyncio.Task] = set()

    def start(req: dict | None) -> None:
        if req is None:
            if not closed.done():
                closed.set_result(None)
            return
        task = loop.create_task(runner.run(req), name=str(req["id"]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def read() -> None:
        while True:
            req = read_frame(requests)
            loop.call_soon_threadsafe(start, req)
            if req is None:
                return

    threading.Thread(target=read, daemon=True, name="rlcore-agent-read").start()
    await closed
    for task in list(tasks):
        task.cancel()


def main(argv: list[str]) -> None:
    """The agent process: ``argv`` = [settings JSON: path, name, socket, memory_mb]."""
    settings = json.loads(argv[0])
    sys.dont_write_bytecode = True  # no __pycache__ in the agent's folder, a DVC dependency
    reply, requests, network = enter_sandbox(int(settings["memory_mb"]))
    try:
        fn = load_agent(settings["path"], settings["name"])
    except BaseException as err:  # noqa: BLE001 - reported in the hello; the worker says it in one line
        write_frame(reply, {"ok": False, "network": network, "error": _one_line(err) if not isinstance(
            err, ValueError) else str(err)})
        return
    write_frame(reply, {"ok": True, "network": network})
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve(fn, settings["socket"], requests, reply))
