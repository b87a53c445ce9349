"""The garbage collector in the processes rlcore owns: a stage script, the ``rlcore`` command.

CPython's cyclic collector walks every object it tracks on each full collection. Once torch, transformers, Ray and
MLflow are loaded, a stage's process tracks about 600,000 objects, nearly all of them parts of modules that live
until the process ends; the full collections that the imports themselves set off (about eight) and the one at
interpreter shutdown walk them again and again. On the 2-core test machine that was ~1.3 s during the imports and
~2.3 s at exit, of the ~13 CPU-s a tiny pipeline's ppo stage spent in its own process (``bench/heap.py``).

In those processes the heavy loading runs in :func:`long_lived` blocks (no automatic collection during the block,
and what it leaves alive is frozen afterwards with ``gc.freeze``, so no later collection walks it again), and
:func:`script` freezes the heap before the interpreter shuts down. Young objects are collected as usual
throughout. Called from Python instead (a test, a notebook), rlcore leaves the collector alone: freezing is
process-wide, and would keep the caller's own objects from ever being collected.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

_owned = False


def owned() -> bool:
    """Whether this process is one rlcore runs as a script (:func:`script`)."""
    return _owned


def script(main: Callable[[], T]) -> T:
    """Run ``main`` as the process's entry point (a stage's ``__main__``, the ``rlcore`` command): :func:`long_lived`
    blocks take effect, and whatever is alive when ``main`` returns or raises is frozen, since it lives until the
    exit anyway (the interpreter's shutdown collection then skips it)."""
    global _owned
    _owned = True
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
