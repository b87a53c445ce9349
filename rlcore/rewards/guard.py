"""Reward functions run guarded: a sample whose function raises or runs past ``reward.timeout_s`` scores
``reward.error_score`` and is counted; the rest of the batch is scored as usual.

    scorer = RewardScorer(timeout_s=10.0, error_score=0.0)
    rewards = scorer.score(data_sources, texts, ground_truths, what="ppo step 3")
    scorer.errors, scorer.timeouts  # totals so far

Where the functions run. A thread cannot be stopped, and a ``SIGALRM`` timer in the controller reaches
Python code only (not C code that never returns to the interpreter), works in the main thread only, and
clashes with reward libraries that arm their own alarm (math-verify does). So the samples are scored in
one long-lived child process (``python -c`` with the controller's ``sys.path``; not a fork of the
controller, which has Ray's threads, and not a ``multiprocessing`` spawn, which imports ``__main__``
again). A batch goes to it in one message; it scores the samples in order and writes each score and
status, and before each sample its index and start time, into shared memory, so the controller knows
which sample is running and since when without a message per sample. The controller sleeps on the pipe
until that sample's deadline; a sample past it gets the process SIGKILLed (which stops anything: a Python
loop, C code, a deadlock), the scores before it are read from shared memory, and the rest of the batch
goes to a fresh process. A process that dies by itself (a segfault, ``os._exit``) costs the sample it was
on the same way, counted with the errors. An exception is caught in the child; the first of a batch
comes back with its traceback.

Costs: the process starts on the first batch (about 0.6 s, mostly importing rlcore.rewards) and again
after each timeout or death. A batch of 256 arithmetic samples takes 0.5 ms instead of 0.16 ms in-process
(one message each way, about 1.3 us per sample), next to 6 ms for decoding them and about 110 ms for a
default PPO step. The functions go to the child with ``cloudpickle``: one defined at module level by
reference (the child imports its module once), a lambda or closure by value. Since they run in the child,
what they change in the controller's globals is not seen there, and what they cache lives as long as the
child. A controller killed with SIGKILL leaves a child that is hung in a function behind (one that is
waiting for the next batch exits when the pipe closes).

``pebble``'s process pool also kills a task that runs too long, but it would cost a message each way per
sample (a task each), or, with one task per batch, lose which sample hung and what the others scored.
"""

from __future__ import annotations

import atexit
import json
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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Sequence

import cloudpickle
import numpy as np

from rlcore.errors import UserError
from rlcore.rewards.rule import REWARD_FNS

CAPACITY = 4096  # samples per message to the scoring process (the shared arrays' length); more go in turns
SETUP_TIMEOUT_S = 120.0  # the scoring process's start and its import of the reward functions' modules
SETUP_POLL_S = 0.05  # how often the controller looks whether setting up is over (which sends nothing)
MESSAGE_CHARS = 300  # of an exception's message, in the one-line summary

# A sample's status; 0: not scored (yet).
OK, RAISED, TIMED_OUT, DIED = 1, 2, 3, 4
# Shared with the scoring process: scores float64[CAPACITY], progress float64[2], status int8[CAPACITY].
SHARED_BYTES = 8 * CAPACITY + 16 + CAPACITY
# The scoring process's program: argv = the controller's sys.path (JSON), the pipe's fd, the shared file's fd.
_CHILD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from rlcore.rewards.guard import _main; _main(int(sys.argv[2]), int(sys.argv[3]))")


class RewardError(UserError):
    """Every sample of a batch failed in its reward function: the function raised or ran past
    ``reward.timeout_s`` on each of them, so there is nothing to learn or report from. The user's code
    (the function registered for the data_source) or data is what to fix; the first failure's traceback
    was printed as a warning just before."""


@dataclass(frozen=True)
class Failure:
    """The first failure of a batch: which data_source, a one-line summary and the traceback."""

    data_source: str
    summary: str
    detail: str


# --------------------------------------------------------------------------- the scoring process
def _describe(err: BaseException) -> tuple[str, str]:
    """``"ValueError: bad (rewards.py:12 in my_reward)"`` and the traceback below the scoring loop."""
    frames = traceback.extract_tb(err.__traceback__)[1:]  # the first frame is _serve's own
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = str(err)
    message = message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "..."
    summary = (f"{type(err).__name__}: {message}" if message else type(err).__name__) + where
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    return summary, "".join(traceback.format_exception(type(err), err, tb)).rstrip()


def _death(code: int) -> str:
    """``"the scoring process was killed by SIGSEGV ..."`` from a Popen return code."""
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    except ValueError:
        how = f"was killed by signal {-code}"
    return f"the scoring process {how} while running the function"


def _as_score(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the reward function returned {value!r:.80}, not a number") from None


def _views(buffer) -> tuple[memoryview[float], memoryview[float], memoryview[int]]:
    """Scores, progress (``[index of the sample being scored, its time.monotonic() start]``) and status
    over the shared buffer (memoryviews: setting an item costs half of what a numpy array's does)."""
    view = memoryview(buffer)
    return (view[:8 * CAPACITY].cast("d"), view[8 * CAPACITY:8 * CAPACITY + 16].cast("d"),
            view[8 * CAPACITY + 16:].cast("b"))


def _main(conn_fd: int, memory_fd: int) -> None:
    """Entry point of the scoring process."""
    memory = mmap.mmap(memory_fd, SHARED_BYTES)
    scores, progress, status = _views(memory)
    _serve(Connection(conn_fd), scores, status, progress)


def _serve(conn, scores, status, progress) -> None:
    """The scoring process: for each message ``(functions, samples)``, score the samples in order into
    the shared arrays, reporting the first exception, then ``("done",)``; ends when the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle; it kills this process
    fns: dict[str, Any] = {}
    while True:
        try:
            payload, samples = conn.recv()
        except EOFError:
            return  # the controller is gone
        for ds, blob in payload.items():
            try:
                fns[ds] = cloudpickle.loads(blob)
            except BaseException as err:  # e.g. its module does not import here: every sample of it fails so
                summary, detail = _describe(err)
                fns[ds] = Failure(ds, f"cannot load the function in the scoring process: {summary}", detail)
        reported, now = False, time.monotonic
        for i, (ds, text, gt) in enumerate(samples):
            progress[1] = now()
            progress[0] = i
            fn = fns[ds]
            if isinstance(fn, Failure):
                status[i] = RAISED
                if not reported:
                    conn.send(("raised", i, fn.summary, fn.detail))
                    reported = True
                continue
            try:
                scores[i] = _as_score(fn(text, gt))
                status[i] = OK
            except BaseException as err:  # SystemExit and KeyboardInterrupt from the function included
                status[i] = RAISED
                if not reported:  # only the first is described (a traceback costs ~0.1 ms)
                    conn.send(("raised", i, *_describe(err)))
                    reported = True
        progress[0] = len(samples)
        conn.send(("done",))


class _Process:
    """One scoring process, its pipe and shared arrays, and the functions it was sent.

    A plain ``python -c`` child with the controller's ``sys.path``, not a ``multiprocessing`` spawn,
    which would import the controller's ``__main__`` again (a script without a ``__main__`` guard would
    start another scoring process from there)."""

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
        self.sent: dict[str, Callable] = {}

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def where(self) -> tuple[int, float]:
        return int(self.progress[0]), self.progress[1]

    def send(self, samples: Sequence[tuple], fns: dict[str, Callable]) -> None:
        payload = {}
        for ds, fn in fns.items():
            if self.sent.get(ds) is not fn:
                try:
                    payload[ds] = cloudpickle.dumps(fn)
                except Exception as err:
                    raise RewardError(f"the reward function of data_source {ds!r} cannot be sent to the scoring "
                                      f"process ({type(err).__name__}: {err})") from None
        self.progress[0], self.progress[1] = -1.0, time.monotonic()  # setting up, from now
        self.conn.send((payload, list(samples)))
        self.sent.update(fns)

    def wait(self, n: int, timeout_s: float, raised: list) -> tuple[int, int | None]:
        """Wait for the ``n`` samples sent: ``(n, None)`` when done; ``(i, TIMED_OUT | DIED)`` when sample
        ``i`` ran past its time (the process is killed) or the process died on it; ``(i, None)`` when the
        process was killed just as it moved on to sample ``i`` (score ``i`` onwards again). The first
        exception's ``(index, summary, traceback)`` is appended to ``raised``. (The child's and this
        process's ``time.monotonic()`` are the same system-wide clock.)"""
        while True:
            i, start = self.where()
            limit = SETUP_TIMEOUT_S if i < 0 else timeout_s
            left = start + limit - time.monotonic()
            if not 0 <= i < n:  # setting up or finishing, which send nothing: look again soon
                left = min(left, SETUP_POLL_S) if i < 0 else SETUP_POLL_S
            try:
                msg = self.conn.recv() if self.conn.poll(max(left, 0.0)) else None
            except (EOFError, OSError):  # the process died
                self.proc.wait()
                i, _ = self.where()
                if i < 0:
                    raise RuntimeError(f"the reward scoring process exited with code {self.proc.returncode} before "
                                       "scoring (see its output above)") from None
                return (i, DIED) if i < n else (n, None)
            if msg is not None:
                if msg[0] == "raised":
                    raised.append(msg[1:])
                    continue
                return n, None
            if self.where() != (i, start) or i >= n or time.monotonic() - start < limit:
                continue  # it moved on meanwhile, is finishing, or is still setting up
            self.kill()
            if self.where() != (i, start):
                return min(self.where()[0], n), None
            if i < 0:
                raise RewardError(f"the reward scoring process did not start scoring within {SETUP_TIMEOUT_S:.0f} s "
                                  "(starting Python and importing the reward functions' modules)")
            return i, TIMED_OUT


class _Scorer:
    """The controller's one scoring process, started on first use and replaced after a timeout or death."""

    def __init__(self) -> None:
        self.process: _Process | None = None
        self.lock = threading.Lock()

    def run(self, samples: list[tuple[str, Any, Any]], fns: dict[str, Callable],
            timeout_s: float) -> tuple[np.ndarray, np.ndarray, list[tuple[int, str, str]], str | None]:
        """Status and score of each sample, the first exception of each message ``(index, summary,
        traceback)``, and a note when the process died on a sample."""
        status: np.ndarray = np.zeros(len(samples), dtype=np.int8)
        scores: np.ndarray = np.zeros(len(samples), dtype=np.float64)
        raised: list[tuple[int, str, str]] = []
        died = None
        with self.lock:
            pos = 0
            while pos < len(samples):
                if self.process is None or self.process.proc.poll() is not None:  # none yet, or it died idle
                    self.process = _Process()
                p = self.process
                part = samples[pos:pos + CAPACITY]
                found: list = []
                try:
                    p.send(part, fns)
                    done, lost = p.wait(len(part), timeout_s, found)
                except BaseException:
                    self.close()
                    raise
                raised += [(pos + j, s, d) for j, s, d in found]
                status[pos:pos + done] = p.status[:done]
                scores[pos:pos + done] = p.scores[:done]
                pos += done
                if lost is not None:
                    if lost == DIED and died is None:
                        died = _death(p.proc.returncode)
                    status[pos], pos = lost, pos + 1
                if p.proc.returncode is not None:
                    self.process = None  # killed or dead: the rest goes to a fresh one
        return status, scores, raised, died

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None


_SCORER = _Scorer()
atexit.register(_SCORER.close)  # the process would also end by itself when the pipe closes, unless it hangs


# --------------------------------------------------------------------------- the controller's side
class RewardScorer:
    """Scores batches with the reward function registered for each sample's data_source, guarded
    (``reward.timeout_s``, ``reward.error_score``). One per stage: it counts the failures (``errors``:
    raised, or the scoring process died; ``timeouts``) and prints the first one's traceback once."""

    def __init__(self, timeout_s: float = 10.0, error_score: float = 0.0):
        self.timeout_s, self.error_score = timeout_s, error_score
        self.errors = self.timeouts = 0
        self._warned = False

    def counts(self) -> tuple[int, int]:
        """``(errors, timeouts)`` so far."""
        return self.errors, self.timeouts

    def score(self, data_sources: Sequence[str], texts: Sequence[str], ground_truths: Sequence[Any], *,
              what: str) -> np.ndarray:
        """``[n]`` float64 rewards; a sample that failed gets ``error_score``. ``what`` names the batch in
        messages (``"ppo step 3"``).

        Raises:
            KeyError: A data_source with no reward function, listing the registered ones.
            RewardError: Every sample failed.
        """
        samples = list(zip(data_sources, texts, ground_truths))
        fns = {ds: REWARD_FNS.get(ds) for ds in dict.fromkeys(data_sources)}
        status, scores, raised, died = _SCORER.run(samples, fns, self.timeout_s)
        failed = status != OK
        if not failed.any():
            return scores
        scores[failed] = self.error_score
        errors, timeouts = int(np.isin(status, (RAISED, DIED)).sum()), int((status == TIMED_OUT).sum())
        self.errors, self.timeouts = self.errors + errors, self.timeouts + timeouts
        first = self._first_failure(samples, status, raised, died)
        errors_text = f"{errors} error{'s' if errors != 1 else ''}" if errors else ""
        timeouts_text = f"{timeouts} ran past reward.timeout_s {self.timeout_s:g} s" if timeouts else ""
        if not self._warned:
            self._warned = True
            counted = ", ".join(t for t in (errors_text, timeouts_text) if t)
            print(f"warning: reward: {int(failed.sum())} of {len(samples)} samples of {what} failed in their reward "
                  f"function ({counted}) and scored reward.error_score {self.error_score:g}; later failures are "
                  f"only counted (reward/errors, reward/timeouts). The first, data_source {first.data_source!r}:\n"
                  f"{first.detail}", file=sys.stderr, flush=True)
        if failed.all():
            sources = ", ".join(repr(ds) for ds in dict.fromkeys(data_sources))
            counted = "; ".join(t for t in (errors_text and f"{errors_text}, the first {first.summary}",
                                            timeouts_text) if t)
            fix = "raise reward.timeout_s or fix the function" if timeouts else "fix the function"
            raise RewardError(f"all {len(samples)} samples of {what} failed in their reward function "
                              f"(data_source {sources}: {counted}); {fix}")
        return scores

    def _first_failure(self, samples: list[tuple], status: np.ndarray, raised: list[tuple[int, str, str]],
                       died: str | None) -> Failure:
        """The first exception (its traceback says the most), else the first timeout, else the death."""
        if raised:
            i, summary, detail = min(raised)
            return Failure(samples[i][0], summary, detail)
        i = int(np.flatnonzero(status != OK)[0])
        if status[i] == TIMED_OUT:
            text = f"ran past reward.timeout_s ({self.timeout_s:g} s) and was stopped"
            return Failure(samples[i][0], text, text)
        text = died or "the scoring process died"
        return Failure(samples[i][0], text, text)
