"""Reward functions run guarded, in scoring processes: a function that raises, returns something that is not a
score, runs past ``reward.timeout_s`` or kills its process costs that one (function, sample) pair, which is
counted; everything else is scored as usual.

    pool = ScoringPool(processes=2)
    outcome = pool.run(samples, specs, timeout_s=10.0)   # one status and score per function and sample

Where the functions run. A thread cannot be stopped, and a ``SIGALRM`` timer in the controller reaches
Python code only (not C code that never returns to the interpreter), works in the main thread only, and
clashes with reward libraries that arm their own alarm (math-verify does). So samples are scored in
long-lived child processes (``python -c`` with the controller's ``sys.path``; not a fork of the controller,
which has Ray's threads, and not a ``multiprocessing`` spawn, which imports ``__main__`` again), where each
function runs on the process's main thread. A batch is split into one contiguous shard per process
(``reward.processes``), so a slow function is scored in parallel; each shard goes to its process in one
message. The process works through the shard function by function: a plain function sample by sample, a
batched one in one call over the shard, an ``async def`` one on all the shard's samples at once (an event
loop, each sample under its own ``asyncio.wait_for``). Before each unit of work (a task: one sample of a
plain function; a phase: the whole call of a batched or async one) it writes, into shared memory, which
tasks it covers, when it started and how long it may take; each result's score and status also go there.
So the controller knows what is running and since when without a message per sample: it sleeps on the
pipes until the earliest deadline, and a unit past its deadline gets its process SIGKILLed (which stops
anything: a Python loop, C code, a deadlock). What was scored before it is read from shared memory, the
unit's unscored tasks count as timed out, and the rest goes to a fresh process. A process that dies by
itself (a segfault, ``os._exit``) costs its unit the same way, counted with the errors. An exception is
caught in the child; the first of each function in a message comes back with its traceback. Extra values
a function returns (a dict with ``score`` and more) come back in messages, batched (every 0.2 s and at the
end of each function's work): those of a process killed mid-shard since its last message are lost (the
scores are not).

Functions reach the processes as specs, not objects: a user's function as ``(file, function name)``, which
the process imports itself (so what the module caches lives in the process); the built-in rule of each
data_source, or a function registered at run time, with ``cloudpickle`` (a module-level function by
reference, a lambda or closure by value).

Costs: a process starts on the first batch (about 0.6 s, mostly importing rlcore.rewards) and again after
each timeout or death. A message costs about 0.1 ms each way and a sample about 1.5 us on top of the
function itself (a float returned; a dict with extra values about 4 us). The controller collects a message's
statuses, scores and extra values with array operations, not per sample.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import math
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import cloudpickle
import numpy as np

from rlcore.errors import UserError
from rlcore.inputs import NotAPythonFile, UserFileNotFound, defined_functions, load_user_module

TASKS_CAP = 1 << 16  # (function, sample) pairs per message (the shared arrays' length); more go in turns
SETUP_TIMEOUT_S = 120.0  # a scoring process's start and its import of the reward functions' modules
POLL_S = 0.05  # how often the controller looks at a process that is setting up or finishing
EXTRAS_FLUSH_S = 0.2  # how often a process sends the extra values it has collected
ASYNC_CONCURRENCY = 64  # samples an async function runs at once in one process
ASYNC_SLACK_S = 5.0  # on top of an async phase's own per-sample timeouts, before its process is killed
MESSAGE_CHARS = 300  # of an exception's message, in the one-line summary

# A (function, sample) pair's status; 0: not scored (yet).
OK, RAISED, TIMED_OUT, DIED, NOT_APPLICABLE = 1, 2, 3, 4, 5
# Shared with a scoring process: scores float64[TASKS_CAP], progress float64[4], status int8[TASKS_CAP].
SHARED_BYTES = 8 * TASKS_CAP + 32 + TASKS_CAP
# The scoring process's program: argv = the controller's sys.path (JSON), the pipe's fd, the shared file's fd.
_CHILD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from rlcore.rewards.guard import _main; _main(int(sys.argv[2]), int(sys.argv[3]))")

Sample = tuple[str, str, Any, Mapping[str, Any]]  # (data_source, solution_str, ground_truth, extra_info)


class RewardError(UserError):
    """A reward function cannot be used (its file does not import, the function is missing or takes other
    arguments, or it fails on a probe row), or every sample of a batch failed in every function: nothing
    to learn or report from. The user's code or data is what to fix."""


@dataclass(frozen=True)
class FunctionSpec:
    """How a scoring process gets one reward function (see the module docstring).

    ``kind``: ``"file"`` (``path`` and ``name``: a user's Python file), ``"pickled"`` (``blob``: a cloudpickled
    callable with verl's signature) or ``"rules"`` (``rules``: data_source -> cloudpickled ``fn(solution_str,
    ground_truth) -> float``; a data_source without one is not applicable, and a rule must return a number).
    """

    label: str
    kind: str
    path: str | None = None
    name: str | None = None
    blob: bytes | None = None
    rules: tuple[tuple[str, bytes], ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    batched: bool = False

    def where(self) -> str:
        """``"rewards/mine.py:compute_score"`` (or the label) for messages."""
        return f"{self.path}:{self.name}" if self.kind == "file" else self.label


@dataclass
class Outcome:
    """What a batch got from its functions: ``status`` and ``scores`` ``[functions, samples]`` (scores are NaN
    unless the status is OK), ``extras[f][key]`` ``[samples]`` (NaN where a sample gave none), the first
    exception of each function ``(sample, summary, traceback)``, and how processes died."""

    status: np.ndarray
    scores: np.ndarray
    extras: list[dict[str, np.ndarray]]
    raised: dict[int, tuple[int, str, str]] = field(default_factory=dict)
    deaths: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the scoring process
def _describe(err: BaseException) -> tuple[str, str]:
    """``"ValueError: bad (rewards.py:12 in my_reward)"`` and the traceback below the scoring loop."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.endswith("rewards/guard.py")]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = str(err)
    message = message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "..."
    summary = (f"{type(err).__name__}: {message}" if message else type(err).__name__) + where
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.endswith("rewards/guard.py"):
        tb = tb.tb_next
    return summary, "".join(traceback.format_exception(type(err), err, tb)).rstrip()


class BadScore(Exception):
    """A reward function returned something that is not a score."""


def _number(value: Any, what: str) -> float:
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        number = float(value)
        if not math.isfinite(number):
            raise BadScore(f"{what} {number}, not a finite number")
        return number
    raise BadScore(f"{what} {value!r:.80} ({type(value).__name__}), not a number")


def as_score(value: Any, *, allow_none: bool) -> tuple[float | None, dict[str, float]]:
    """``(score, extras)`` from what a function returned: a number; None (not applicable) where allowed; a
    mapping with ``score`` (a number, or None where allowed) and extra values (the numeric ones are kept).
    Anything else, and NaN or infinity, raises :class:`BadScore`."""
    extras: dict[str, float] = {}
    if isinstance(value, (dict, Mapping)):  # dict first: typing.Mapping's isinstance goes through the ABC machinery
        if "score" not in value:
            raise BadScore(f"returned a dict without 'score' (keys: {', '.join(map(str, value))})")
        for key, extra in value.items():
            if key != "score" and isinstance(extra, (bool, int, float, np.integer, np.floating)):
                number = float(extra)
                if math.isfinite(number):
                    extras[str(key)] = number
        value = value["score"]
        what = "returned score"
    else:
        what = "returned"
    if value is None:
        if allow_none:
            return None, extras
        raise BadScore(f"{what} None; a data_source's rule must return a number")
    return _number(value, what), extras


def load_function(spec: FunctionSpec) -> Callable:
    """The callable of a ``"file"`` or ``"pickled"`` spec, checked against verl's signature; raises
    :class:`RewardError` naming the file and function."""
    if spec.kind == "pickled":
        assert spec.blob is not None
        fn = cloudpickle.loads(spec.blob)
    else:
        fn = _from_file(spec)
    if not callable(fn):
        raise RewardError(f"reward function {spec.where()}: {type(fn).__name__} object, not a function")
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", {}, **dict(spec.kwargs))
    except TypeError as err:
        raise RewardError(f"reward function {spec.where()}{_signature(fn)} cannot be called as fn(data_source, "
                          f"solution_str, ground_truth, extra_info{', **kwargs' if spec.kwargs else ''}) ({err})") from None
    except ValueError:  # no signature to inspect (a C function): the call will tell
        pass
    return fn


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


def _from_file(spec: FunctionSpec) -> Any:
    assert spec.path is not None and spec.name is not None
    try:
        module = load_user_module(spec.path, "rlcore_reward")
    except UserFileNotFound:
        raise RewardError(f"reward file {spec.path}: not found") from None
    except NotAPythonFile:
        raise RewardError(f"reward file {spec.path}: not a Python file") from None
    except BaseException as err:  # the file's own code failed while importing
        summary, _ = _describe(err)
        raise RewardError(f"reward file {spec.path} does not import: {summary}") from None
    if not hasattr(module, spec.name):
        names = defined_functions(module)
        raise RewardError(f"reward file {spec.path} has no function {spec.name!r} (it defines: "
                          f"{', '.join(names) or 'none'})")
    return getattr(module, spec.name)


class _Child:
    """The scoring process's state: the loaded functions and the shared arrays."""

    def __init__(self, conn: Connection, scores, status, progress):
        self.conn, self.scores, self.status, self.progress = conn, scores, status, progress
        self.fns: dict[str, Any] = {}  # label -> callable, {data_source: rule}, or RewardError
        self.meta: dict[str, tuple[dict[str, Any], bool]] = {}  # label -> (kwargs, batched)
        self.extras: dict[str, tuple[list[int], list[float]]] = {}  # key -> (tasks, values) since the last flush
        self.last_flush = time.monotonic()
        self.reported: set[int] = set()

    def load(self, specs: Sequence[FunctionSpec]) -> None:
        for spec in specs:
            self.meta[spec.label] = (dict(spec.kwargs), spec.batched)
            try:
                if spec.kind == "rules":
                    rules = self.fns.get(spec.label)
                    rules = dict(rules) if isinstance(rules, dict) else {}
                    rules.update({ds: cloudpickle.loads(blob) for ds, blob in spec.rules})
                    self.fns[spec.label] = rules
                else:
                    self.fns[spec.label] = load_function(spec)
            except BaseException as err:
                self.fns[spec.label] = err if isinstance(err, RewardError) else RewardError(
                    f"reward function {spec.where()} cannot be loaded in the scoring process: {_describe(err)[0]}")

    def begin(self, first: int, end: int, limit: float) -> None:
        """Publish the unit of work about to run: tasks ``[first, end)``, from now, for ``limit`` seconds."""
        p = self.progress
        p[3], p[2], p[1] = float(end), limit, time.monotonic()
        p[0] = float(first)

    def record(self, t: int, c: int, value: Any, allow_none: bool) -> None:
        if (type(value) is float or type(value) is int) and math.isfinite(value):  # the common case, without
            self.scores[t] = float(value)  # as_score's checks (isinstance over ABCs costs ~1 us a sample)
            self.status[t] = OK
            return
        try:
            score, extras = as_score(value, allow_none=allow_none)
        except BadScore as err:
            self.fail(t, c, err, "")
            return
        for key, extra in extras.items():
            column = self.extras.get(key)
            if column is None:
                column = self.extras[key] = ([], [])
            column[0].append(t)
            column[1].append(extra)
        if score is None:
            self.status[t] = NOT_APPLICABLE
        else:
            self.scores[t] = score
            self.status[t] = OK

    def fail(self, t: int, c: int, err: BaseException, detail: str | None = None) -> None:
        self.status[t] = RAISED
        if c not in self.reported:  # only the first of each function is described (a traceback costs ~0.1 ms)
            self.reported.add(c)
            summary, tb = _describe(err) if detail is None else (str(err), str(err))
            self.conn.send(("raised", t, summary, tb))

    def flush(self, force: bool = False) -> None:
        if self.extras and (force or time.monotonic() - self.last_flush > EXTRAS_FLUSH_S):
            self.conn.send(("extras", self.extras))
            self.extras = {}
            self.last_flush = time.monotonic()

    def serve(self) -> None:
        """For each message ``(specs, order, samples, start, timeout_s)``: score tasks ``start..`` (task
        ``c * n + i``: function ``order[c]`` on sample ``i``) into the shared arrays, then ``("done",)``;
        ends when the pipe closes."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle; it kills this process
        while True:
            try:
                specs, order, samples, start, timeout_s = self.conn.recv()
            except EOFError:
                return  # the controller is gone
            self.begin(-1, -1, SETUP_TIMEOUT_S)
            self.load(specs)
            self.reported = set()
            n, t = len(samples), start
            while t < len(order) * n:
                c, i = divmod(t, n)
                t = self.run_function(c, order[c], samples, i, n, timeout_s)
            self.flush(force=True)
            self.begin(len(order) * n, len(order) * n, SETUP_TIMEOUT_S)
            self.conn.send(("done",))

    def run_function(self, c: int, label: str, samples: list, i: int, n: int, timeout_s: float) -> int:
        """Score samples ``i..n-1`` with function ``c``; returns the next task."""
        fn, (kwargs, batched) = self.fns[label], self.meta[label]
        first, end = c * n + i, (c + 1) * n
        if isinstance(fn, BaseException):
            for t in range(first, end):
                self.fail(t, c, fn, str(fn))
            return end
        if isinstance(fn, dict):  # the rule of each sample's data_source
            for t in range(first, end):
                ds, text, gt, _ = samples[t - c * n]
                self.begin(t, t + 1, timeout_s)
                rule = fn.get(ds)
                if rule is None:
                    self.status[t] = NOT_APPLICABLE
                    continue
                try:
                    self.record(t, c, rule(text, gt), allow_none=False)
                except BaseException as err:  # SystemExit and KeyboardInterrupt from the function included
                    self.fail(t, c, err)
            self.flush()
            return end
        part = samples[i:]
        if batched:
            self.begin(first, end, timeout_s)
            try:
                values = fn(*(list(col) for col in zip(*part)), **kwargs)
                if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(part):
                    raise BadScore(f"a batched function returned {type(values).__name__}"
                                   f"{f' of length {len(values)}' if hasattr(values, '__len__') else ''}; "
                                   f"expected a list of {len(part)} scores")
            except BaseException as err:
                for t in range(first, end):
                    self.fail(t, c, err, None if not isinstance(err, BadScore) else "")
                return end
            for k, value in enumerate(values):
                self.record(first + k, c, value, allow_none=True)
        elif inspect.iscoroutinefunction(fn):
            rounds = math.ceil(len(part) / ASYNC_CONCURRENCY)
            self.begin(first, end, timeout_s * rounds + ASYNC_SLACK_S)
            asyncio.run(self._gather(fn, kwargs, part, first, c, timeout_s))
        else:
            for k, sample in enumerate(part):
                self.begin(first + k, first + k + 1, timeout_s)
                try:
                    self.record(first + k, c, fn(*sample, **kwargs), allow_none=True)
                except BaseException as err:
                    self.fail(first + k, c, err)
                self.flush()
        self.flush(force=True)
        return end

    async def _gather(self, fn, kwargs, part, first: int, c: int, timeout_s: float) -> None:
        gate = asyncio.Semaphore(ASYNC_CONCURRENCY)

        async def one(k: int, sample) -> None:
            async with gate:
                try:
                    value = await asyncio.wait_for(fn(*sample, **kwargs), timeout_s)
                except asyncio.TimeoutError:
                    self.status[first + k] = TIMED_OUT
                    return
                except BaseException as err:
                    self.fail(first + k, c, err)
                    return
                self.record(first + k, c, value, allow_none=True)

        await asyncio.gather(*(one(k, s) for k, s in enumerate(part)))


def _views(buffer) -> tuple[memoryview[float], memoryview[float], memoryview[int]]:
    """Scores, progress (``[first task of the unit running, its time.monotonic() start, its limit in seconds,
    the task after the unit]``) and status over the shared buffer (memoryviews: setting an item costs half
    of what a numpy array's does)."""
    view = memoryview(buffer)
    return (view[:8 * TASKS_CAP].cast("d"), view[8 * TASKS_CAP:8 * TASKS_CAP + 32].cast("d"),
            view[8 * TASKS_CAP + 32:].cast("b"))


def _main(conn_fd: int, memory_fd: int) -> None:
    """Entry point of a scoring process."""
    memory = mmap.mmap(memory_fd, SHARED_BYTES)
    scores, progress, status = _views(memory)
    _Child(Connection(conn_fd), scores, status, progress).serve()


# --------------------------------------------------------------------------- the controller's side
def _death(code: int) -> str:
    """``"the scoring process was killed by SIGSEGV ..."`` from a Popen return code."""
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    except ValueError:
        how = f"was killed by signal {-code}"
    return f"the scoring process {how} while running the function"


class _Process:
    """One scoring process, its pipe and shared arrays, and the specs it holds."""

    def __init__(self) -> None:
        memory = tempfile.TemporaryFile()  # removed at once; the child maps the same file through its fd
        os.ftruncate(memory.fileno(), SHARED_BYTES)
        self.memory = mmap.mmap(memory.fileno(), SHARED_BYTES)
        self.scores, self.progress, self.status = _views(self.memory)
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        fds = (theirs.fileno(), memory.fileno())
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path), *map(str, fds)],
                                     pass_fds=fds, stdin=subprocess.DEVNULL)
        theirs.close()
        memory.close()
        self.held: dict[str, FunctionSpec] = {}
        self.job: _Job | None = None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def unit(self) -> tuple[int, float, float, int]:
        """``(first task, start, limit, end)`` of the unit of work running now (first -1: setting up)."""
        p = self.progress
        while True:
            first, start, limit, end = int(p[0]), p[1], p[2], int(p[3])
            if int(p[0]) == first and p[1] == start:  # not rewritten while we read it
                return first, start, limit, end

    def send(self, job: _Job, specs: Sequence[FunctionSpec], timeout_s: float) -> None:
        """Start ``job``'s remaining tasks; only the specs this process does not hold yet travel."""
        new = [s for s in specs if self.held.get(s.label) != s]
        np.frombuffer(self.memory, np.int8, TASKS_CAP, 8 * TASKS_CAP + 32)[:len(specs) * job.n] = 0  # the last job's
        self.progress[1], self.progress[2], self.progress[3] = time.monotonic(), SETUP_TIMEOUT_S, -1.0
        self.progress[0] = -1.0
        self.conn.send((new, [s.label for s in specs], job.samples, job.next, timeout_s))
        self.held.update({s.label: s for s in new})
        self.job = job


@dataclass
class _Job:
    """A contiguous run of samples ``[lo, hi)`` of the batch, scored by one process at a time."""

    lo: int
    samples: list
    next: int = 0  # the next task to send (task c * n + i)
    done: bool = False

    @property
    def n(self) -> int:
        return len(self.samples)


class ScoringPool:
    """The controller's scoring processes, started on first use, replaced after a timeout or a death, and
    killed at exit."""

    def __init__(self, processes: int = 1) -> None:
        self.size = processes
        self.slots: list[_Process | None] = [None] * processes
        self.lock = threading.Lock()
        atexit.register(self.close)

    def run(self, samples: Sequence[Sample], specs: Sequence[FunctionSpec], timeout_s: float) -> Outcome:
        """Score every sample with every function (see the module docstring)."""
        c_count, n = len(specs), len(samples)
        out = Outcome(np.zeros((c_count, n), np.int8), np.full((c_count, n), np.nan), [{} for _ in specs])
        if not n or not c_count:
            return out
        per_job = max(1, TASKS_CAP // c_count)
        shards = np.array_split(np.arange(n), min(self.size, n))
        jobs = [_Job(int(lo), list(samples[lo:min(lo + per_job, int(s[-1]) + 1)]))
                for s in shards for lo in range(int(s[0]), int(s[-1]) + 1, per_job)]
        with self.lock:
            try:
                self._run_jobs(jobs, specs, timeout_s, out)
            except BaseException:
                self.close()
                raise
        return out

    def _run_jobs(self, jobs: list[_Job], specs: Sequence[FunctionSpec], timeout_s: float, out: Outcome) -> None:
        waiting = list(jobs)
        while True:
            for k, p in enumerate(self.slots):  # every idle process takes the next job
                if waiting and (p is None or p.job is None):
                    if p is None or p.proc.poll() is not None:
                        p = self.slots[k] = _Process()
                    p.send(waiting.pop(0), specs, timeout_s)
            busy = [p for p in self.slots if p is not None and p.job is not None]
            if not busy:
                return
            now = time.monotonic()
            pause = min(_pause(p, now) for p in busy)
            for conn in wait([p.conn for p in busy], max(pause, 0.0)):
                p = next(q for q in busy if q.conn is conn)
                self._receive(p, specs, out)
            now = time.monotonic()
            for p in busy:
                if p.job is not None and self.slots[self.slots.index(p)] is p:
                    self._check_deadline(p, specs, out, now)
            waiting += [j for j in jobs if not j.done and j not in waiting
                        and not any(q is not None and q.job is j for q in self.slots)]

    def _receive(self, p: _Process, specs: Sequence[FunctionSpec], out: Outcome) -> None:
        job = p.job
        assert job is not None
        try:
            while p.conn.poll():
                msg = p.conn.recv()
                if msg[0] == "raised":  # the first of each function in the batch's order
                    c, i = divmod(msg[1], job.n)
                    if c not in out.raised or job.lo + i < out.raised[c][0]:
                        out.raised[c] = (job.lo + i, msg[2], msg[3])
                elif msg[0] == "extras":  # {key: (tasks, values)}
                    for key, (tasks, values) in msg[1].items():
                        c, i = np.divmod(np.asarray(tasks), job.n)
                        for f in np.unique(c):
                            column = out.extras[f].get(key)
                            if column is None:
                                column = out.extras[f][key] = np.full(out.status.shape[1], np.nan)
                            mine = c == f
                            column[job.lo + i[mine]] = np.asarray(values)[mine]
                else:  # done
                    self._collect(p, out, len(specs) * job.n)
                    job.next, job.done, p.job = len(specs) * job.n, True, None
                    return
        except (EOFError, OSError):  # the process died
            p.proc.wait()
            first, _, _, end = p.unit()
            if first < 0:
                self._drop(p)
                raise RewardError(f"the reward scoring process exited with code {p.proc.returncode} while loading "
                                  "the reward functions (see its output above)") from None
            out.deaths.append(_death(p.proc.returncode))
            self._lose(p, specs, out, first, end, DIED)

    def _check_deadline(self, p: _Process, specs: Sequence[FunctionSpec], out: Outcome, now: float) -> None:
        first, start, limit, end = p.unit()
        if now - start < limit or (first >= 0 and first >= len(specs) * p.job.n):
            return
        p.kill()
        if p.unit()[:2] != (first, start):  # it moved on just before the kill: resend from where it was
            first, _, _, end = p.unit()
            self._lose(p, specs, out, first, first if first >= 0 else 0, TIMED_OUT)
            return
        if first < 0:
            self._drop(p)
            raise RewardError(f"the reward scoring process did not start scoring within {SETUP_TIMEOUT_S:.0f} s "
                              "(starting Python and importing the reward functions' modules)")
        self._lose(p, specs, out, first, end, TIMED_OUT)

    def _lose(self, p: _Process, specs: Sequence[FunctionSpec], out: Outcome, first: int, end: int, why: int) -> None:
        """``p`` was killed or died in the unit ``[first, end)``: keep what it scored, mark the unit's unscored
        tasks ``why``, and leave the job's rest to a fresh process."""
        job = p.job
        assert job is not None
        self._collect(p, out, end)
        for t in range(first, end):
            c, i = divmod(t, job.n)
            if out.status[c, job.lo + i] == 0:
                out.status[c, job.lo + i] = why
        job.next, p.job = end, None
        if end >= len(specs) * job.n:
            job.done = True
        self._drop(p)

    def _collect(self, p: _Process, out: Outcome, upto: int) -> None:
        """Copy ``p``'s statuses and scores of its job's tasks ``[job.next, upto)`` into ``out``."""
        job = p.job
        assert job is not None
        status = np.frombuffer(p.memory, np.int8, TASKS_CAP, 8 * TASKS_CAP + 32)[job.next:upto]
        scores = np.frombuffer(p.memory, np.float64, TASKS_CAP)[job.next:upto]
        done = np.flatnonzero(status)
        c, i = np.divmod(job.next + done, job.n)
        out.status[c, job.lo + i] = status[done]
        ok = status[done] == OK
        out.scores[c[ok], job.lo + i[ok]] = scores[done[ok]]

    def _drop(self, p: _Process) -> None:
        if p.proc.returncode is None:
            p.kill()
        else:
            p.conn.close()
        self.slots[self.slots.index(p)] = None

    def close(self) -> None:
        for p in self.slots:
            if p is not None:
                p.kill()
        self.slots = [None] * self.size


def _pause(p: _Process, now: float) -> float:
    """How long the controller may sleep before it must look at ``p`` again."""
    first, start, limit, end = p.unit()
    left = start + limit - now
    if first < 0 or first >= end:  # setting up or finishing, which send nothing: look again soon
        return min(left, POLL_S)
    return left


_POOLS: dict[int, ScoringPool] = {}


def pool_of(processes: int) -> ScoringPool:
    """The stage's one pool of ``processes`` scoring processes (created on first use)."""
    if processes not in _POOLS:
        _POOLS[processes] = ScoringPool(processes)
    return _POOLS[processes]
