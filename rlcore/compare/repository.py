"""The repository a comparison runs in, through git and DVC: each cell one ``dvc exp run`` from the committed
baseline, read back from its experiment commit."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlcore.errors import UserError

TAIL_LINES = 12  # output lines of a failed cell shown in the report


class Repository:
    """The DVC repository the cells run in (commands with the current Python's environment first on PATH, so
    the stages run the interpreter that has rlcore)."""

    def __init__(self, root: Path):
        self.root = root
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        local = Path(bin_dir) / "dvc"
        self.dvc = str(local) if local.exists() else (shutil.which("dvc") or "dvc")

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, cwd=self.root, env=self.env, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise UserError(f"`{' '.join(cmd)}` failed in {self.root}: {(proc.stderr or proc.stdout).strip()[-500:]}")
        return proc

    def check(self) -> str:
        """The baseline commit; a UserError unless this is a DVC repository with a commit and no uncommitted
        change to a tracked file (each cell starts from the commit, so such a change would be lost)."""
        if not (self.root / "dvc.yaml").is_file() or not (self.root / ".dvc").is_dir():
            raise UserError(f"{self.root}: not a DVC repository (no dvc.yaml or .dvc/); run rlcore compare in one")
        head = self._run("git", "rev-parse", "--verify", "HEAD", check=False)
        if head.returncode != 0:
            raise UserError(f"{self.root}: no git commit yet; dvc exp run needs one (git add -A && git commit)")
        changed = [line[3:] for line in self._run("git", "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
                   if line.strip()]
        if changed:
            files = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise UserError(f"uncommitted changes to tracked files ({files}): commit or stash them; every cell starts "
                            "from the last commit, the baseline of its experiment")
        return head.stdout.strip()

    def restore(self) -> None:
        """Tracked files back to the baseline commit (params.yaml, dvc.lock, metrics, plots)."""
        self._run("git", "checkout", "HEAD", "--", ".")

    @contextmanager
    def baseline_kept(self) -> Iterator[None]:
        """Leave the workspace as it was, whatever runs inside: tracked files come back from the commit, DVC's
        cached outputs from its cache (``dvc checkout``), and its uncached outputs that git does not track (a
        round's rollouts, the evaluation samples) from a copy taken on the way in."""
        from dvc.repo import Repo

        with Repo(str(self.root)) as dvc_repo:
            uncached = [Path(out.fs_path) for out in dvc_repo.index.outs if not out.use_cache]
        with tempfile.TemporaryDirectory() as tmp:
            saved = []
            for path in uncached:
                if path.is_file():
                    rel = path.relative_to(self.root)
                    (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, Path(tmp) / rel)
                    saved.append(rel)
            try:
                yield
            finally:
                self.restore()
                if self._run(self.dvc, "checkout", "--force", "-q", check=False).returncode != 0:
                    print("rlcore compare: warning: some of the baseline's DVC outputs are not in the cache (it never "
                          "ran here?), so the workspace holds the last cell's; `dvc status` lists them, `dvc repro` "
                          "or `dvc pull` brings them back", file=sys.stderr)
                for rel in saved:
                    (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(Path(tmp) / rel, self.root / rel)

    def experiments(self) -> dict[str, str]:
        """``{name: rev}`` of the baseline's experiments (``dvc exp show --json``)."""
        proc = self._run(self.dvc, "exp", "show", "--json", "--no-fetch", check=False)
        if proc.returncode != 0:
            proc = self._run(self.dvc, "exp", "show", "--json")
        found: dict[str, str] = {}
        for baseline in json.loads(proc.stdout or "[]"):
            for exp in baseline.get("experiments") or []:
                for rev in exp.get("revs") or []:
                    if rev.get("name") and rev.get("rev"):
                        found[rev["name"]] = rev["rev"]
        return found

    def remove(self, names: list[str]) -> None:
        if names:
            self._run(self.dvc, "exp", "remove", *names)

    def run_experiment(self, name: str, sets: list[str], log: Path) -> tuple[int, float]:
        """``dvc exp run -n name -S ...``, its output (stdout and stderr) to ``log`` and echoed; exit code, seconds."""
        cmd = [self.dvc, "exp", "run", "-n", name, *itertools.chain.from_iterable(("-S", s) for s in sets)]
        start = time.monotonic()
        with log.open("w") as out:
            out.write(f"$ {shlex.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, cwd=self.root, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
            code = proc.wait()
        return code, time.monotonic() - start

    def read(self, rev: str, path: str) -> str:
        proc = self._run("git", "show", f"{rev}:{path}", check=False)
        if proc.returncode != 0:
            raise FileNotFoundError(f"{path} is not in experiment commit {rev[:10]}")
        return proc.stdout


def tail(path: Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` non-blank lines of a log as a terminal shows them (a progress bar's line is its last
    redraw, after its last carriage return)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", path.read_text(errors="replace"))  # colours, cursor moves
    shown = (line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n"))
    lines = [line for line in shown if line.strip()]
    return "\n".join(lines[-n:])
