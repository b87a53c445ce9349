"""Step checkpoints and resume, for every training loop (``sft``, the ``ppo@<round>`` stages).

Every ``save_every`` steps a loop writes one folder, ``<checkpoint.dir>/<stage>/step_<N>``, holding all a
stage needs to continue exactly where it was after step N:

* the workers' files (``rlcore.workers.state``): each trained model's weights, optimizer state and
  learning-rate schedule, unsharded, and every rank's RNG;
* ``controller.pt``: the loop's own state (the prompt sampler's position and RNG, the KL controller, the
  metric rows and plot rows so far, the rollouts kept, the policy version), the MLflow run id and the
  fingerprint below.

The folder is built under ``step_<N>.tmp``; its files are fsynced, then it is renamed (an atomic step on one
filesystem) and the parent folder is fsynced. A kill at any point leaves the previous complete checkpoint
intact and at worst a ``.tmp`` folder, which the next run removes. While the stage runs, the newest
``max(keep_last, 1)`` checkpoints are kept; when it succeeds, the newest ``keep_last`` (default 0: none).

**Resume.** When the stage starts, :meth:`StepCheckpoints.resume` looks at the complete checkpoints, newest
first, and resumes from the first it can use: one whose fingerprint equals this run's and whose files are all
there as they were written. The fingerprint is the stage's own: its params (minus the keys whose declaration in
``rlcore.config`` says they cannot change the steps done, :data:`~rlcore.config.KEEPS_STEPS`: ``save_every``,
``max_nonfinite_steps``, the ``checkpoint`` and ``tracking`` sections, ``ray``), its code (a hash of every file under the ``rlcore/`` and ``stages/`` dependencies ``dvc.yaml`` lists for the
stage, the same files whose change makes DVC re-run it; every ``.py`` of both folders where there is no
``dvc.yaml``) and its input files (a content hash; files over 256 MiB are hashed by size and their first and
last 16 MiB). So an edit to a module the stage does not run (``rlcore/serve/app.py`` for ``sft``) keeps its
checkpoints. Each checkpoint it cannot use is removed, with one line naming it and why (the first changed key,
file or input; an unreadable or incomplete folder); older ones that match are kept. The checkpoint folder is
outside DVC's outputs (DVC deletes a stage's outputs before re-running it, never this folder) and ignored by
git and DVC.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import yaml

from rlcore.config import flatten, step_params
from rlcore.errors import UserError

CONTROLLER_FILE = "controller.pt"
BIG_FILE = 256 * 2**20
EDGE = 16 * 2**20


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (no space, an unwritable folder): the message names the path."""


FILESYSTEM_ERRORS = ("No space left", "Permission denied", "Read-only file system", "Disk quota", "Not a directory")


def write_error(err: BaseException, what: str, intact: str) -> BaseException:
    """A CheckpointWriteError ``"<what>: <reason> (<intact>)"`` when ``err`` (raised here or on a worker, then
    wrapped by Ray) is a filesystem error, else ``err`` itself: a bug keeps its traceback."""
    text = str(err)
    for marker in FILESYSTEM_ERRORS:
        if marker in text:
            return CheckpointWriteError(f"{what}: {marker} ({intact})")
    return err


@dataclass(frozen=True)
class Resume:
    """A complete checkpoint that matches this run: continue after ``step`` steps."""

    step: int
    folder: Path
    state: dict[str, Any]
    """The loop's controller state as it saved it."""

    @property
    def run_id(self) -> str | None:
        return self.state.get("run_id")


def file_digest(path: Path) -> str:
    """sha256 of the file's content (of its size and first and last ``EDGE`` bytes above ``BIG_FILE``)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= BIG_FILE:
            for block in iter(lambda: f.read(2**20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            h.update(f.read(EDGE))
            f.seek(size - EDGE)
            h.update(f.read(EDGE))
    return h.hexdigest()


def tree_digests(paths: Iterable[str | Path], pattern: str = "*") -> dict[str, str]:
    """``{path: digest}`` of each file, or of each file under each folder matching ``pattern``."""
    out: dict[str, str] = {}
    for p in map(Path, paths):
        files = sorted(f for f in p.rglob(pattern) if f.is_file() and "__pycache__" not in f.parts) \
            if p.is_dir() else [p]
        for f in files:
            out[str(f)] = file_digest(f)
    return out


CODE_FOLDERS = ("rlcore/", "stages/")


def stage_code(root: Path, stage: str) -> list[str] | None:
    """The code dependencies ``root/dvc.yaml`` lists for ``stage`` (``ppo@r1`` is the ``ppo`` stage): the entries
    under ``rlcore/`` and ``stages/``, as written there. None when there is no ``dvc.yaml`` or no such stage."""
    try:
        stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    body = stages.get(stage.split("@")[0]) if isinstance(stages, dict) else None
    if not isinstance(body, dict):
        return None
    deps = (body.get("do") or body).get("deps") or []
    names = [name for d in deps for name in (d if isinstance(d, dict) else [d])]
    return [d for d in names if isinstance(d, str) and d.startswith(CODE_FOLDERS)]


def code_digests(root: Path, deps: Iterable[str] | None = None) -> dict[str, str]:
    """The code a stage runs: every file under each of ``deps`` (paths relative to ``root``, as ``dvc.yaml`` lists
    them; a dependency that does not exist is recorded as missing), or with ``deps`` None every ``.py`` of
    ``rlcore/`` and ``stages/``."""
    if deps is None:
        digests = tree_digests([root / "rlcore", root / "stages"], "*.py")
    else:
        present = [root / d for d in deps if (root / d).exists()]
        digests = tree_digests(present)
        digests.update({str(root / d): "missing" for d in deps if not (root / d).exists()})
    return {str(Path(k).relative_to(root)): v for k, v in digests.items()}


def fingerprint(params: dict[str, Any], *, root: Path, inputs: Iterable[str | Path],
                code: Iterable[str] | None = None) -> dict[str, Any]:
    """What a checkpoint must match to be resumed from: params (the stage's declared sections, less what their
    declarations say cannot change the steps: :func:`~rlcore.config.step_params`), the code under
    ``code`` (the stage's code dependencies, :func:`stage_code`; None: all of ``rlcore/`` and ``stages/``), the
    input files."""
    flat = flatten(step_params(params))
    data = {input_key(path, root): digest for path, digest in tree_digests(inputs).items()}
    return {"params": flat, "code": code_digests(root, code), "data": data}


def input_key(path: str | Path, root: Path) -> str:
    """An input file's name in a fingerprint: relative to ``root`` when it is under it, else absolute; normalised
    (``..`` and ``.`` gone, symbolic links kept), so one file named relatively (``--data data/x.parquet``) or
    absolutely, on the run that saved a checkpoint and on the one that resumes, has one name."""
    full, base = os.path.abspath(path), os.path.abspath(root)
    rel = os.path.relpath(full, base)
    return full if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def first_difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """One phrase naming the first difference between two fingerprints, or None when they match."""
    for part, what in (("params", "params changed"), ("code", "code changed"), ("data", "input data changed")):
        a, b = saved.get(part, {}), now.get(part, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                if part == "params":
                    return f"{what}: {key} {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}"
                change = "added" if key not in a else "removed" if key not in b else "modified"
                return f"{what}: {key} {change}"
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StepCheckpoints:
    """The step checkpoints of one stage (module docstring). ``save_every`` 0 turns saving off; resuming
    from a checkpoint left by an earlier run still works."""

    def __init__(self, folder: str | Path, *, stage: str, save_every: int, keep_last: int, fingerprint: dict[str, Any]):
        self.folder = Path(folder)
        self.stage = stage
        self.save_every = save_every
        self.keep_last = keep_last
        self.fingerprint = fingerprint
        self.written = 0
        self.seconds = 0.0  # spent writing checkpoints (from begin to commit)
        self._started = time.perf_counter()
        self._begun = 0.0

    # ------------------------------------------------------------------ reading
    def complete(self) -> list[tuple[int, Path]]:
        """``(step, folder)`` of every complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            name = p.name
            if p.is_dir() and name.startswith("step_") and name[5:].isdigit() and (p / CONTROLLER_FILE).is_file():
                found.append((int(name[5:]), p))
        return sorted(found)

    def resume(self) -> Resume | None:
        """The newest complete checkpoint this run can use (one line says so), else None. Each newer one it cannot
        use (other params, code or inputs; unreadable; a file missing or cut short) is removed, with one line
        naming it and why; older ones are left as they are."""
        self._remove_partial()
        found = self.complete()
        for step, folder in reversed(found):
            state, why = self._usable(folder)
            if state is not None:
                print(f"resuming {self.stage} from step {step} ({folder})", flush=True)
                return Resume(step, folder, state)
            print(f"{self.stage}: not resuming from {folder}: {why}; removed it", file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)
        if found:
            print(f"{self.stage}: no usable step checkpoint; starting over", file=sys.stderr, flush=True)
        return None

    def _usable(self, folder: Path) -> tuple[dict[str, Any] | None, str]:
        """``(state, "")`` for a checkpoint this run can resume from, else ``(None, why not)``."""
        try:
            state = torch.load(folder / CONTROLLER_FILE, map_location="cpu", weights_only=False)
        except Exception as err:  # a checkpoint we cannot read is not one to resume from
            return None, f"unreadable ({type(err).__name__}: {err})"
        why = first_difference(state.get("fingerprint", {}), self.fingerprint)
        if why:
            return None, why
        for name, size in state.get("files", {}).items():  # what the workers wrote, as commit() found it
            path = folder / name
            if not path.is_file():
                return None, f"incomplete: {name} is missing"
            if path.stat().st_size != size:
                return None, f"incomplete: {name} has {path.stat().st_size} bytes, {size} were written"
        return state, ""

    # ------------------------------------------------------------------ writing
    def due(self, done: int, total: int) -> bool:
        """Whether to checkpoint after ``done`` of ``total`` steps (never after the last: the stage's
        outputs are written then)."""
        return self.save_every > 0 and done % self.save_every == 0 and done < total

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for the checkpoint after ``step`` steps; the workers write into it."""
        self._begun = time.perf_counter()
        tmp = self.folder / f"step_{step:08d}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            raise CheckpointWriteError(f"{self.stage}: cannot write checkpoint folder {tmp}: {err.strerror or err}; "
                                       f"set checkpoint.dir to a writable path") from None
        return tmp

    def commit(self, tmp: Path, step: int, state: dict[str, Any]) -> Path:
        """Add the controller state to ``tmp`` and make it the newest complete checkpoint."""
        from rlcore.workers.state import atomic_save

        final = self.folder / f"step_{step:08d}"
        try:
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic_save({**state, "step": step, "fingerprint": self.fingerprint, "files": files},
                        tmp / CONTROLLER_FILE)
            _fsync_dir(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.folder)
        except OSError as err:
            self.abort(tmp)
            raise CheckpointWriteError(f"{self.stage}: cannot write checkpoint {final}: {err.strerror or err} "
                                       "(the previous checkpoint is intact)") from None
        self._prune(max(self.keep_last, 1))
        self.written += 1
        self.seconds += time.perf_counter() - self._begun
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def worker_error(self, tmp: Path, err: BaseException) -> BaseException:
        """The error to raise when the workers failed to write into ``tmp``: a CheckpointWriteError naming
        the path for a filesystem error (no space, permissions), else ``err`` itself (a bug)."""
        self.abort(tmp)
        return write_error(err, f"{self.stage}: cannot write checkpoint {tmp}", "the previous checkpoint is intact")

    def finish(self) -> None:
        """The stage succeeded: keep the newest ``keep_last`` checkpoints (none by default), and say what
        checkpointing cost."""
        if self.written:
            share = self.seconds / max(time.perf_counter() - self._started, 1e-9)
            print(f"{self.stage}: {self.written} step checkpoint(s), {self.seconds / self.written:.3f} s each, "
                  f"{share:.1%} of the stage", flush=True)
        self._remove_partial()
        self._prune(self.keep_last)
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()

    def _prune(self, keep: int) -> None:
        found = self.complete()
        for _, folder in found[: max(0, len(found) - keep)]:
            shutil.rmtree(folder, ignore_errors=True)

    def _remove_partial(self) -> None:
        if self.folder.is_dir():
            for p in self.folder.glob("step_*.tmp"):
                shutil.rmtree(p, ignore_errors=True)


def stage_checkpoints(cfg, *, stage: str, save_every: int, params: dict[str, Any], root: Path,
                      inputs: Iterable[str | Path]) -> StepCheckpoints:
    """The stage's :class:`StepCheckpoints` under ``checkpoint.dir`` (relative to ``root``), fingerprinted with the
    stage's own code dependencies from ``root/dvc.yaml``."""
    folder = Path(cfg.checkpoint.dir)
    if not folder.is_absolute():
        folder = root / folder
    return StepCheckpoints(folder / stage, stage=stage, save_every=save_every, keep_last=cfg.checkpoint.keep_last,
                           fingerprint=fingerprint(params, root=root, inputs=inputs, code=stage_code(root, stage)))
