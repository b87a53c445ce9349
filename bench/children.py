"""Parent side of ``bench.wire``: start one system as a child process and drive it.

A reader thread files the child's ``@@bench`` records in a queue and its other output in
``bench/_work/logs/<name>.log``; :meth:`Child.run` sends ``run K`` and waits for K step
records and the pause that follows.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from bench import wire
from bench.settings import REPO_ROOT, WORK_DIR


class ChildError(RuntimeError):
    pass


class Child:
    def __init__(self, name: str, module: str, env: dict[str, str] | None = None, timeout_s: float = 600.0,
                 cwd: Path | None = None):
        self.name, self.timeout_s = name, timeout_s
        self.log_path = WORK_DIR / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.records: queue.Queue = queue.Queue()
        full_env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", module], cwd=cwd or REPO_ROOT, env=full_env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with Path(self.log_path).open("w") as log:
            for line in self.proc.stdout:
                rec = wire.parse(line)
                if rec is None:
                    log.write(line)
                    log.flush()
                else:
                    self.records.put(rec)
        self.records.put({"kind": "eof"})

    def expect(self, kind: str) -> dict:
        """Wait for the next record; it must be of ``kind``."""
        try:
            rec = self.records.get(timeout=self.timeout_s)
        except queue.Empty:
            raise ChildError(f"{self.name}: no {kind!r} within {self.timeout_s:g}s (see {self.log_path})") from None
        if rec["kind"] != kind:
            raise ChildError(f"{self.name}: expected {kind!r}, got {rec['kind']!r} (see {self.log_path})")
        return rec

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def run(self, k: int, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Run k steps; return their records (``on_step`` sees each one as it arrives)."""
        self.send(f"run {k}")
        steps = []
        for _ in range(k):
            steps.append(self.expect("step"))
            if on_step:
                on_step(steps[-1])
        self.expect("paused")
        return steps

    def probe(self, reps: int) -> dict:
        """Ours only: time bare Ray group calls and calls carrying one step's Batch."""
        self.send(f"probe {reps}")
        return self.expect("probe")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


def other_checkout(root: Path) -> Path:
    """The checkout B runs, with this one's prepared data (its ``bench/_work`` a link to ours)."""
    root = root.resolve()
    if not (root / "rlcore").is_dir() or not (root / "bench" / "ours.py").is_file():
        raise SystemExit(f"--b-root {root}: not an rlcore checkout (no rlcore/ or bench/ours.py there)")
    work = root / "bench" / WORK_DIR.name
    if work.is_symlink():
        if work.resolve() == WORK_DIR.resolve():
            return root
        work.unlink()  # a link elsewhere (or to nothing): ours instead
    elif work.exists():
        raise SystemExit(f"--b-root {root}: {work} is a folder of its own; remove it, so that B reads this "
                         "checkout's prepared data")
    work.symlink_to(WORK_DIR.resolve(), target_is_directory=True)
    return root


def commit_of(root: Path) -> str:
    """The checkout's commit, ``+changes`` when its tracked files differ from it."""
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    return commit + ("+changes" if dirty else "")
