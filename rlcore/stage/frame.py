"""The frame of every stage script: argument parsing, config loading, clean failures, outputs.

A stage script reads as the same four steps: :func:`parser` (the arguments every stage has, and the reward and tool
input folders where it reads them), ``rlcore.stage.run.stage_setup`` in :func:`stage_errors` (the params sections
it declares in ``PARAMS`` and dvc.yaml, validated, and the recorded hashes of its reward and tool files), its heavy
imports in ``rlcore.heap.long_lived``, then its work inside ``rlcore.stage.run.stage_run`` (its MLflow run, nested
under the pipeline's). :func:`stage_config` hands a stage only the sections it declares, so a stage cannot depend on a
key that dvc.yaml does not list. Importing this module loads no torch, pandas, pyarrow or ray: a stage validates its
params and input paths before anything heavy starts.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rlcore.config import Config, load_config, section_dict
from rlcore.errors import VLLM_INSTALL_HINT, ConfigError, InputNotFound, TrainingDiverged, UserError, WorkerDied
from rlcore.interrupt import Terminated, on_signal

REPO_ROOT = Path.cwd()
# EX_TEMPFAIL (sysexits.h): the run failed for a reason outside the input; running it again is the fix.
EXIT_WORKER_DIED = 75
# A training that diverged (non-finite losses): not bad input (2), not a bug (1, with a traceback), and a re-run
# with the same params diverges again (unlike 75): its own code, so a script can tell it apart.
EXIT_DIVERGED = 3


def parser(doc: str | None, *, rewards: bool = False, tools: bool = False) -> argparse.ArgumentParser:
    """A stage's arguments: ``--params``, ``--metrics``; ``rewards``: ``--rewards``, the folder of the reward
    inputs' manifests; ``tools``: ``--tools``, the tool files'. ``rlcore.stage.run.stage_setup`` records the inputs of
    those a stage declares."""
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--metrics", required=True, help="metrics JSON to write")
    if rewards:
        p.add_argument("--rewards", required=True, help="folder of the reward inputs' manifests (rlcore.inputs)")
    if tools:
        p.add_argument("--tools", default=None, help="folder of the tool files' manifests (rlcore.inputs); without "
                                                     "it, the files are hashed as they are")
    return p


@contextmanager
def stage_errors(stage: str) -> Iterator[None]:
    """How a stage ends when something goes wrong.

    * Bad input (``rlcore.errors.UserError``: params, paths, data rows, model folders): one line on
      stderr naming the key, file or row, exit code 2.
    * A training that diverged (``rlcore.errors.TrainingDiverged``: too many consecutive optimizer steps
      with a non-finite loss or gradient norm): one line naming the step and the last finite metrics,
      exit code 3 (the plot CSV and the MLflow run, which ends FAILED, keep every step so far).
    * A worker rank lost during a call (``rlcore.errors.WorkerDied``: its process killed or crashed, its
      node gone): one line naming the worker group, rank and method, exit code 75 (the worker groups
      and the placement group are gone by then; the re-run resumes from the last step checkpoint).
    * Ctrl-C or SIGTERM: one line, exit code 130 or 143; during a training loop the first one lets the
      step in flight finish and writes a step checkpoint first (``rlcore.interrupt``). The process that started
      this one exiting counts as SIGTERM (``dvc repro`` killed: DVC does not pass its SIGTERM on, and the stage
      would otherwise train on, orphaned, with its workers and tool processes); either way the worker groups
      stop before the stage exits, and their tool processes with them.
    * Anything else is a bug: it propagates with its full traceback (exit code 1).
    """
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    _term_with_parent(signal.SIGTERM)
    try:
        yield
    except UserError as err:
        print(f"{stage}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrainingDiverged as err:
        print(f"{stage}: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_DIVERGED) from None
    except WorkerDied as err:
        _leave_ray()
        print(f"{stage}: error: {err}; run the stage again to resume from its last step checkpoint "
              "(if it wrote one)", file=sys.stderr)
        raise SystemExit(EXIT_WORKER_DIED) from None
    except Terminated:
        print(f"{stage}: terminated (SIGTERM)", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM) from None
    except KeyboardInterrupt:
        print(f"{stage}: interrupted", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        _term_with_parent(0)  # as it was: a caller's own process (a test, a notebook) keeps running
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _term_with_parent(signum: int) -> None:
    """Have the kernel send this process ``signum`` when its parent exits (Linux ``PR_SET_PDEATHSIG``; 0: none;
    elsewhere nothing): a stage whose ``dvc repro`` was killed stops as if it got SIGTERM itself. A parent already
    gone by then counts at once."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if signum and os.getppid() != parent:
        os.kill(os.getpid(), signum)


def _leave_ray() -> None:
    """Disconnect from Ray now (a private local instance stops), rather than at exit: the workers' last log
    lines then come before the stage's error line, not after it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def require_file(path: str, what: str) -> None:
    if not Path(path).exists():
        raise InputNotFound(f"{what} {path!r} not found (run the earlier stages: dvc repro)")


class DeclaredConfig:
    """A view of Config that refuses sections the stage did not declare in dvc.yaml."""

    def __init__(self, cfg: Config, sections: tuple[str, ...], stage: str):
        self._cfg, self._sections, self._stage = cfg, frozenset(sections), stage

    def __getattr__(self, name: str) -> Any:
        inner = tuple(s.split(".", 1)[1] for s in self._sections if s.startswith(f"{name}."))
        if name not in self._sections and inner:  # a declared part of the section ("rollout.agent")
            return DeclaredConfig(getattr(self._cfg, name), inner, self._stage)
        if name not in self._sections:
            raise AttributeError(f"stage {self._stage} reads params section {name!r}, which it does not declare "
                                 f"(declared: {', '.join(sorted(self._sections))}); add it to PARAMS and dvc.yaml")
        return getattr(self._cfg, name)


def check_engine_installed(cfg: Config, source: str) -> None:
    """``rollout.engine`` vllm where vLLM cannot be imported: ConfigError saying how to install it, before any work
    (the other engines come with rlcore)."""
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{source}: rollout.engine vllm: {VLLM_INSTALL_HINT}")


def stage_config(path: str, sections: tuple[str, ...], stage: str) -> tuple[Config, dict[str, Any]]:
    """The config, validated as a whole, as seen by ``stage``, and its declared sections as plain data. A stage that
    declares ``ray`` runs on it: a ``ray.address`` where nothing answers fails here, in seconds, before the stage's
    imports of torch, transformers and Ray (about 10 s of CPU) and before it opens its MLflow run."""
    cfg = load_config(path)
    if "rollout" in sections:
        check_engine_installed(cfg, path)
    if "resources" in sections:  # before the stage imports torch: its kernels are chosen then
        # here, not at the top: a stage that declares no resources (prepare) does not load it (dvc.yaml's deps)
        from rlcore.kernels import pin

        if warning := pin(cfg.resources.cpu_kernels):
            print(warning, file=sys.stderr, flush=True)
    if "ray" in sections:
        from rlcore.controller.address import check_reachable  # as rlcore.kernels: only the stages that use Ray

        check_reachable(cfg.ray.address)
    return DeclaredConfig(cfg, sections, stage), section_dict(cfg, sections)  # type: ignore[return-value]


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
