"""The tool process: where a tool function or an environment actually runs, and the framing both sides speak.

A tool process is ``python -c`` with the worker's ``sys.path`` (not a fork of a Ray worker, which has threads, and
not a ``multiprocessing`` spawn, which imports ``__main__`` again). Before it imports any tool file it:

* asks the kernel to SIGKILL it when the thread that started it ends (``PR_SET_PDEATHSIG``): a worker that dies
  leaves no tool process behind;
* keeps its own stdout as the reply channel and points file descriptors 1 and 2 at ``/dev/null``, so nothing a
  tool writes (``print``, a C library, a subprocess) reaches the worker's log or the channel; ``print`` inside a
  call is captured (bounded) instead;
* leaves the network: a new user and network namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``) where only a
  down loopback exists, so ``connect`` fails with "Network is unreachable". Where the kernel refuses unprivileged
  namespaces, socket creation for internet families is refused at the Python level instead (a tool calling C code
  could get round that one); the hello message says which of the two is in force;
* caps its address space (``resource.setrlimit(RLIMIT_AS)``): an allocation past it raises ``MemoryError``.

Time is limited from outside: the worker kills the whole process group (the tool's own children too) when a call
runs past its timeout (:mod:`rlcore.agents.tools`).

Messages are 4-byte big-endian lengths followed by JSON. Requests: ``describe``; ``call`` (a tool function with
keyword arguments); ``reset``/``step``/``reward``/``close`` (an environment instance held under a key). Replies:
``{"ok": true, "text", "chars", ...}`` or ``{"ok": false, "error": <kind>, "text": <one line>}``. Only the
standard library is imported here (pydantic and docstring_parser for ``describe`` alone).
"""

from __future__ import annotations

import ctypes
import inspect
import io
import json
import os
import resource
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path
from typing import Any, BinaryIO

from rlcore.inputs import MissingUserObject, load_user_object

HEADER = struct.Struct(">I")
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG = 1
MESSAGE_CHARS = 300  # of an exception's message in an error observation


# ------------------------------------------------------------------------------------------------ framing
def write_frame(stream: BinaryIO, message: dict) -> None:
    data = json.dumps(message, ensure_ascii=False, default=str).encode()
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> dict | None:
    """The next message, or None at end of file."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return json.loads(data)


# ---------------------------------------------------------------------------------------- the sandbox
def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the worker's atexit kill still applies
        pass


def _leave_network() -> str:
    """``"namespace"`` when this process now has no network at all, else ``"python"`` after refusing internet
    sockets in Python (see the module docstring)."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "unshare") and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        try:  # keep our own uid and gid inside (unmapped ids read as "nobody")
            Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
            Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
        except OSError:
            pass
        return "namespace"

    real = socket.socket

    class _NoInternet(real):  # type: ignore[misc,valid-type]
        def __init__(self, family: int = -1, *args: Any, **kwargs: Any):
            if family in (-1, socket.AF_INET, socket.AF_INET6):
                raise PermissionError("network access is disabled in the tool sandbox")
            super().__init__(family, *args, **kwargs)

    socket.socket = _NoInternet  # type: ignore[misc]
    return "python"


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class BoundedText(io.TextIOBase):
    """A text stream that keeps its first ``cap`` characters and counts all of them (``print`` inside a call)."""

    def __init__(self, cap: int):
        self.cap, self.parts, self.kept, self.chars = cap, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.chars += len(s)
        if self.kept < self.cap:
            self.parts.append(s[: self.cap - self.kept])
            self.kept += len(self.parts[-1])
        return len(s)

    def value(self) -> str:
        return "".join(self.parts)


def _one_line(err: BaseException) -> str:
    message = " ".join(str(err).split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + "..."
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def as_text(value: Any) -> str:
    """A tool's return value as observation text: strings as they are, everything else as JSON (``str`` for what
    JSON cannot hold)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


class Sandbox:
    """The tool process's state: the loaded objects (or why each failed to load) and the environment instances."""

    def __init__(self, tools: list[dict]):
        self.objects: dict[str, Any] = {}
        self.broken: dict[str, str] = {}
        for t in tools:
            try:
                self.objects[t["name"]] = load_user_object(t["path"], t["name"], "tool", "rlcore_tool")
            except MissingUserObject as err:
                self.broken[t["name"]] = f"tool {t['name']!r} ({t['path']}) did not load: {err}"
            except BaseException as err:  # noqa: BLE001 - reported per tool, at every use
                self.broken[t["name"]] = f"tool {t['name']!r} ({t['path']}) did not load: {_one_line(err)}"
        self.envs: dict[str, Any] = {}

    def handle(self, req: dict) -> dict:
        op = req["op"]
        if op == "describe":
            from rlcore.agents.schema import describe  # pydantic, docstring_parser: only when asked to describe

            return {"ok": True, "tools": {name: describe(obj, name) for name, obj in self.objects.items()},
                    "broken": self.broken}
        if op == "close":
            self.envs.pop(req["env"], None)
            return {"ok": True, "text": "", "chars": 0}
        capture = BoundedText(req.get("max_chars", 0) + 1)
        sys.stdout = capture
        try:
            return self._run(op, req, capture)
        except _BadArguments as err:
            return {"ok": False, "error": "bad_arguments", "text": str(err)}
        except BaseException as err:  # noqa: BLE001 - every failure of user code is an observation
            return {"ok": False, "error": "raised", "text": _one_line(err), "trace": traceback.format_exc(limit=-4)}
        finally:
            sys.stdout = sys.__stdout__

    def _target(self, name: str) -> Any:
        if name in self.broken:
            raise RuntimeError(self.broken[name])
        return self.objects[name]

    def _run(self, op: str, req: dict, capture: BoundedText) -> dict:
        cap = req.get("max_chars", 0)
        if op == "call":
            fn = self._target(req["name"])
            try:
                signature = inspect.signature(fn)
                signature.bind(**req["args"])
            except TypeError as err:
                raise _BadArguments(f"arguments do not fit {req['name']}{signature}: {err}") from None
            except ValueError:  # no signature (a C function): the call will tell
                pass
            value = fn(**req["args"])
            text = capture.value() if value is None else as_text(value)
            chars = capture.chars if value is None else len(text)
            return {"ok": True, "text": text[:cap], "chars": chars}
        if op == "reset":
            env = self._target(req["name"])()
            self.envs[req["env"]] = env
            env.reset(req["row"])
            return {"ok": True, "text": "", "chars": 0}
        env = self.envs.get(req["env"])
        if env is None:
            return {"ok": False, "error": "env_lost", "text": "the environment's state was lost (its tool process was "
                                                              "restarted after another call failed)"}
        if op == "step":
            return _step_reply(env.step(req["action"]), cap)
        if op == "reward":
            reward = float(env.reward())
            self.envs.pop(req["env"], None)
            return {"ok": True, "text": "", "chars": 0, "reward": reward}
        raise ValueError(f"unknown request {op!r}")


class _BadArguments(TypeError):
    """A call whose arguments do not fit the tool's signature."""


def _step_reply(out: Any, cap: int) -> dict:
    """An environment's ``step`` result: an observation (``None``: the episode is over), or a tuple
    ``(observation, reward, done)``."""
    reward, done = None, out is None
    if isinstance(out, tuple):
        if len(out) != 3:
            raise TypeError(f"step returned a tuple of {len(out)}; expected (observation, reward, done)")
        out, reward, done = out[0], float(out[1]), bool(out[2])
    text = "" if out is None else as_text(out)
    return {"ok": True, "text": text[:cap], "chars": len(text), "reward": reward, "done": done}


def enter_sandbox(memory_mb: int) -> tuple[BinaryIO, BinaryIO, str]:
    """This process in the sandbox (module docstring): dying with the thread that started it, its output to
    ``/dev/null``, out of the network, its memory capped. Returns the reply channel (a copy of stdout), the request
    channel (stdin) and how the network is refused (:func:`_leave_network`)."""
    _die_with_parent()
    reply = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sys.stdout = sys.__stdout__ = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    sys.stderr = sys.__stderr__ = sys.stdout
    network = _leave_network()
    _limit_memory(memory_mb)
    return reply, sys.stdin.buffer, network


def main(argv: list[str]) -> None:
    """The tool process: ``argv`` = [tools JSON, memory_mb]."""
    reply, requests, network = enter_sandbox(int(argv[1]))
    box = Sandbox(json.loads(argv[0]))
    write_frame(reply, {"ok": True, "network": network, "broken": box.broken})
    while (req := read_frame(requests)) is not None:
        write_frame(reply, box.handle(req))
