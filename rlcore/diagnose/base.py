"""What every check of ``rlcore diagnose`` shares: the :class:`Check` a check returns, the :class:`Context` it
reads, the registry of checks in report order (:data:`CHECKS`, ``@register``), running each bounded in time,
and the few helpers several checks use (the repository root, a child process killed at its deadline).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rlcore import cache
from rlcore.config import Config

Status = Literal["ok", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail")

DEFAULT_TIMEOUT_S = 60.0
# a check that ignores its own deadline is abandoned this long after it
GRACE_S = 5.0


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, how it went, what was found, and what to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    """What to do; required for warn and fail."""
    seconds: float = 0.0
    """How long the check took (set by :func:`run_check`)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        if self.status != "ok" and not self.fix:
            raise ValueError(f"check {self.name}: a {self.status} needs a fix")


@dataclass(frozen=True)
class Context:
    """What every check may read."""

    cfg: Config
    """The validated params (the built-in defaults when the params do not validate)."""
    root: Path
    """The repository: the folder holding ``.dvc/`` at or above the working directory, else the
    working directory. Relative paths in params (sqlite URI, model.path) resolve against it, as in the stages."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds each check may take."""


CheckFn = Callable[[Context], Check]
# name -> check, in report order
CHECKS: dict[str, CheckFn] = {}
# checks that only wait on child processes (no imports, no shared state): they start with the report
# and overlap the others
BACKGROUND: set[str] = set()


def register(name: str, *, background: bool = False) -> Callable[[CheckFn], CheckFn]:
    def decorator(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"diagnose check {name!r} is already registered")
        CHECKS[name] = fn
        if background:
            BACKGROUND.add(name)
        return fn

    return decorator


def start_check(name: str, fn: CheckFn, ctx: Context) -> Callable[[], Check]:
    """Start ``fn(ctx)`` in a daemon thread; the returned function waits for its :class:`Check`.

    The wait is bounded by ``ctx.timeout_s`` (plus :data:`GRACE_S`) from the start: a check stuck
    in a call that cannot be interrupted (a CUDA driver that never answers) is abandoned and
    reported as a failure. An exception is a failure too, with its traceback on stderr: the report
    goes on with the other checks.
    """
    box: list[Check] = []

    def target() -> None:
        try:
            check = fn(ctx)
        except Exception as err:
            traceback.print_exc()
            check = Check(name, "fail", f"the check raised {type(err).__name__}: {err}",
                          "see the traceback on stderr (a broken install of what this check loads, or a bug)")
        box.append(replace(check, seconds=round(time.monotonic() - start, 2)))

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"diagnose-{name}", daemon=True)
    thread.start()

    def wait() -> Check:
        thread.join(max(0.0, start + ctx.timeout_s + GRACE_S - time.monotonic()))
        if not box:
            return Check(name, "fail", f"no answer within {ctx.timeout_s:g}s",
                         "rerun with a longer --timeout; if it hangs again, this is the problem",
                         seconds=round(time.monotonic() - start, 2))
        return box[0]

    return wait


def run_check(name: str, fn: CheckFn, ctx: Context) -> Check:
    """``fn(ctx)`` with its duration, bounded in time (:func:`start_check`)."""
    return start_check(name, fn, ctx)()


def run_checks(ctx: Context, skip: frozenset[str] | set[str] = frozenset()) -> Iterator[Check]:
    """Every registered check not in ``skip``, in order, each as soon as it and those before it are
    done. The :data:`BACKGROUND` checks start at once and run beside the others."""
    names = [n for n in CHECKS if n not in skip]
    started = {n: start_check(n, CHECKS[n], ctx) for n in names if n in BACKGROUND}
    for name in names:
        yield started[name]() if name in started else run_check(name, CHECKS[name], ctx)


def repo_root(start: Path) -> Path:
    """The folder holding ``.dvc/`` at or above ``start`` (what ``dvc root`` prints), else ``start``."""
    return find_dvc_root(start) or start


def find_dvc_root(start: Path) -> Path | None:
    for folder in (start.resolve(), *start.resolve().parents):
        if (folder / ".dvc").is_dir():
            return folder
    return None


def model_cache() -> Path:
    """Where the built-in model is materialised: ``rlcore.engine.model.TINY_CACHE`` (not imported
    from there: that module loads torch and transformers)."""
    return cache.root()



def worst(statuses: list[Status]) -> Status:
    return max(statuses, key=STATUSES.index, default="ok")


def run_bounded(cmd: list[str], timeout_s: float, cwd: Path | None = None) -> tuple[int | None, str, str]:
    """``cmd``'s exit code, stdout and stderr; exit code None when it ran past ``timeout_s``, in which
    case its whole process group (Ray's raylet and GCS included) is killed."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err
