"""Which CPU kernels rlcore's processes compute with: the same bits on any x86-64 CPU with AVX2, or the libraries'
own choice.

PyTorch and MKL each pick their code by the CPU they run on: ATen's vectorised loops (softmax, reductions, SiLU,
norms) come in AVX2 and AVX-512 builds that add in other orders; MKL's matrix products and vector math (``exp``,
``log``, ``sqrt``) choose their code path and blocking by CPU vendor, model and cache sizes. So one commit's
pipeline gives another model on another CPU.

``resources.cpu_kernels: portable`` (the default) fixes both in every process rlcore starts. :func:`pin` sets the
environment before torch is imported (the stage scripts and the ``rlcore`` command where they load the params;
the worker groups pass the same variables to each rank's process through Ray's ``runtime_env``, :func:`inherited`):

* ``ATEN_CPU_CAPABILITY=avx2``: PyTorch's AVX2 loops (PyTorch takes the lower of this and what the CPU has);
* ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's kernels no newer than AVX2 (nothing of a float32 step reaches oneDNN).

Then :func:`activate`, in each process about to compute, installs the portable kernels
(:mod:`rlcore.engine.portable_ops`): the matrix products and ``sqrt`` on rlcore's own kernels, whose every element
is one fused multiply-add chain in a fixed order (the same bits from their AVX-512, AVX2 and scalar code, for any
blocking, thread count or batch), MKL's vector math on SLEEF's AVX2 functions, and torch's own loops on one
thread. MKL computes nothing of the step, so its settings (``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``) do not
matter.

``native`` leaves each library its own choice (MKL's products and vector math, ATen's widest loops, and the
rank's threads for all of them): the fastest code the libraries pick, with results that differ between CPU models.

A CPU without AVX2, or not x86-64, gets no pin: the portable kernels then run their scalar code (the same
products), but ATen's loops match only machines of the same kind.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

MODE_ENV = "RLCORE_CPU_KERNELS"
"""The kernel choice (``portable`` or ``native``) :func:`pin` made, for :func:`activate` and the processes after."""

PORTABLE = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The environment of a process that computes the portable way (before torch is imported)."""

MODES = ("portable", "native")


def has_avx2(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this is an x86-64 CPU with AVX2 (read from the kernel's CPU flags, without importing torch)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " avx2" in line for line in text.splitlines())


def pin(mode: str) -> str | None:
    """Set this process's kernel choice for ``mode`` (``portable`` or ``native``), before torch is imported. None
    when done as asked; a line saying why not otherwise (no AVX2 here; torch already imported: nothing changes)."""
    if mode not in MODES:
        raise ValueError(f"unknown cpu kernels mode {mode!r}; choose from {', '.join(MODES)}")
    os.environ[MODE_ENV] = mode
    if mode == "native":
        return None
    if not has_avx2():
        return ("cpu kernels: portable asked, but this CPU has no AVX2: portable products, but PyTorch's own loops "
                "match only CPUs of this kind")
    if "torch" in sys.modules and any(os.environ.get(k) != v for k, v in PORTABLE.items()):
        return "cpu kernels: portable asked after torch was imported in this process: its loops stay as chosen"
    os.environ.update(PORTABLE)
    return None


def inherited() -> dict[str, str]:
    """The kernel variables this process was pinned with, for the processes it starts through Ray (whose workers
    do not inherit the driver's environment on a cluster)."""
    return {k: os.environ[k] for k in (*PORTABLE, MODE_ENV) if k in os.environ}


def mode() -> str:
    """The kernel choice :func:`pin` made in this process (or its parent), ``native`` if none was made."""
    return os.environ.get(MODE_ENV, "native")


KEPT_BLOCK_BYTES = 32 << 20
"""glibc's largest mmap threshold: blocks up to this size come from the heap and stay there when freed."""


def keep_freed_memory() -> bool:
    """Keep memory this process frees for its next allocations instead of handing it back to the kernel (glibc only;
    False elsewhere, where nothing changes). A training step allocates and frees the same activations and gradients
    every step; by default glibc unmaps or trims most of them, and the next step takes every 4 KiB page again as a
    fault the kernel zeroes: 6,600-120,000 faults and up to 0.22 s of system time a step on one rank of the `long`
    bench shape, none of them with this, at the same peak memory (``bench.update_ceiling``'s workload). Blocks of up
    to 32 MiB come from the heap and freed ones are reused; the arithmetic is untouched."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameters (malloc.h)
    return bool(libc.mallopt(m_mmap_threshold, KEPT_BLOCK_BYTES)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def activate(threads: int | None = 1) -> str:
    """Make this process compute with the kernels :func:`pin` chose, on ``threads`` threads (None: torch's default,
    one per core); call it where the process is about to compute (a stage, a command, a rank). Portable: the portable
    kernels installed, the products' rows shared by ``threads`` threads, torch's own loops on one. Native: torch's
    threads. Either way freed memory is kept for reuse (:func:`keep_freed_memory`). Returns what runs the matrix
    products, for the logs (``portable (avx512)``, ``native (mkl)``)."""
    import torch  # only where the process computes: rlcore.kernels itself is read before torch is imported

    keep_freed_memory()
    if mode() == "portable":
        from rlcore.engine import portable_ops  # loads (and, once per machine, builds) the kernels

        return f"portable ({portable_ops.install(threads or torch.get_num_threads())})"
    if threads is not None:
        torch.set_num_threads(threads)
    return "native (mkl)" if torch.backends.mkl.is_available() else "native"
