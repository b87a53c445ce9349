"""The garbage collector in the processes rlcore owns: a stage script, the ``rlcore`` command.

CPython's cyclic collector walks every object it tracks on each full collection. Once torch, transformers, Ray and
MLflow are loaded, a stage's process tracks about 600,000 objects, nearly all of them parts of modules that live
until the process ends; the full collections that the imports themselves set off (about eight) and the one at
interpreter shutdown walk them again and again. On the 2-core test machine that was ~1.3 s during the imports and
~2.3 s at exit, of the ~13 CPU-s a tiny pipeline's ppo stage spent in its own process (``bench.heap``, a study
whose command and results are in bench/EXPERIMENTS.md).

In those processes the heavy loading runs in :func:`long_lived` blocks (no automatic collection during the block,
and what it leaves alive is frozen afterwards with ``gc.freeze``, so no later collection walks it again), and
:func:`script` freezes the heap before the interpreter shuts down. Young objects are collected as usual
throughout. The processes Ray starts for a worker group's ranks are rlcore's too: the group starts them with
``RLCORE_RANK_PROCESS`` set, and the worker module's imports (torch, transformers, rlcore) run with no automatic
collection from the process's start until ``RankWorker.__init__`` (:func:`rank_loading`, which Ray runs as the
job's ``worker_process_setup_hook`` in every worker it starts for a session rlcore began or joined, and
:func:`rank_ready`); models are never frozen (a frozen object in a reference cycle would never be freed, and a
worker may load one model after another). Called from Python instead (a test, a notebook), rlcore leaves the
collector alone: freezing is process-wide, and would keep the caller's own objects from ever being collected.

The same two entry points (:func:`script`, :func:`rank_loading`) install ``rlcore.import_index`` before the
process imports transformers: its lazy-import table is read from rlcore's cache instead of being built twice.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rlcore import import_index

T = TypeVar("T")

RANK_PROCESS_ENV = "RLCORE_RANK_PROCESS"
"""Set (to ``1``) in the environment of the processes Ray starts for a worker group's ranks."""

RANK_SETUP_HOOK = f"{__name__}.rank_loading"
"""Ray's ``worker_process_setup_hook`` (a job-level ``runtime_env`` key) of the sessions rlcore starts or joins:
:func:`rank_loading`, run in each worker process Ray starts before it takes any task or actor."""

_owned = False


def owned() -> bool:
    """Whether this process is one of rlcore's own: a script (:func:`script`) or a rank's (:func:`rank_loading`)."""
    return _owned


def script(main: Callable[[], T]) -> T:
    """Run ``main`` as the process's entry point (a stage's ``__main__``, the ``rlcore`` command): :func:`long_lived`
    blocks take effect, and whatever is alive when ``main`` returns or raises is frozen, since it lives until the
    exit anyway (the interpreter's shutdown collection then skips it)."""
    global _owned
    _owned = True
    import_index.install()  # before main's imports: transformers' lazy-import table from rlcore's cache
    try:
        return main()
    finally:
        gc.freeze()


@contextmanager
def long_lived() -> Iterator[None]:
    """A block that loads what the process keeps to its end (heavy imports, a tokenizer, a tracking store): in a
    process rlcore owns, no automatic collection runs during it, and everything alive at its end is frozen. The
    collector's enabled state is restored afterwards (blocks nest). Elsewhere it changes nothing."""
    if not _owned:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def rank_process_env() -> dict[str, str]:
    """The environment variable a rank's actor is started with (``runtime_env``'s ``env_vars``)."""
    return {RANK_PROCESS_ENV: "1"}


def rank_loading() -> None:
    """Ray's setup hook of every worker process (:data:`RANK_SETUP_HOOK`): in a process started for a rank
    (:data:`RANK_PROCESS_ENV`), no automatic collection until :func:`rank_ready`; in any other, nothing. The
    variable is taken out of the environment, so that processes the rank starts do not inherit it."""
    global _owned
    if os.environ.pop(RANK_PROCESS_ENV, None) == "1":
        _owned = True
        gc.disable()
        import_index.install()


def rank_ready() -> None:
    """Run by ``RankWorker.__init__``: the worker's modules are loaded; freeze them and collect as usual from here."""
    if _owned and not gc.isenabled():
        gc.freeze()
        gc.enable()
