"""Which CPU kernels rlcore's processes compute with: the same bits on any x86-64 CPU with AVX2, or the fastest.

PyTorch, MKL and oneDNN each pick their kernels by the CPU they run on: ATen's vectorised loops (softmax,
reductions, SDPA, exp and log) come in AVX2 and AVX-512 builds whose sums run in other orders; MKL's GEMM picks
its blocking and code path by CPU vendor, model and cache sizes. So one commit's pipeline gave another model on
another CPU (the README's SFT pass@1 0.484 on one 2-core Xeon, 0.520 on another; each machine repeated itself bit
for bit).

``resources.cpu_kernels: portable`` (the default) fixes all three before torch is imported, in every process
rlcore starts: the stage scripts and the ``rlcore`` command pin their own process (:func:`pin`, called where they
load the params), the worker groups pass the same variables to each rank's process (:func:`inherited`, Ray's
``runtime_env``), and the scoring and tool processes inherit them. The thread counts are fixed already (one per
stage driver, ``cpus_per_worker`` per rank), as MKL's reproducibility needs. ``native`` leaves each library its
own choice (and whatever the environment asks of it).

* ``ATEN_CPU_CAPABILITY=avx2``: PyTorch's AVX2 kernels (PyTorch takes the lower of this and what the CPU has);
* ``MKL_CBWR=COMPATIBLE,STRICT``: MKL's conditional numerical reproducibility (fixed blocking, reductions and
  scheduling; strict: whatever the data's alignment) on its one branch that gives the same results on Intel and
  other vendors' CPUs (SSE2 without the approximate rcpps/rsqrtps instructions). Its AVX2 branch is faster
  (measured on one 2-core AMD EPYC, one thread: 38-64 GFLOP/s against 20-30 for fp32 GEMMs of the bench's
  shapes, 53-82 unpinned) but MKL documents it for Intel CPUs only: elsewhere it falls back to its automatic
  branch, which differs from Intel's;
* ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's kernels (convolutions, bf16 matmuls) no newer than AVX2.

A CPU without AVX2, or not x86-64, gets no pin: its results match only machines of its own kind.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

PORTABLE = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The environment of a process that computes the portable way."""

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
    if mode == "native":
        return None
    if not has_avx2():
        return "cpu kernels: portable asked, but this CPU has no AVX2: native kernels (results match this CPU kind)"
    if "torch" in sys.modules and any(os.environ.get(k) != v for k, v in PORTABLE.items()):
        return "cpu kernels: portable asked after torch was imported in this process: its kernels stay as chosen"
    os.environ.update(PORTABLE)
    return None


def inherited() -> dict[str, str]:
    """The kernel variables this process was pinned with, for the processes it starts through Ray (whose workers
    do not inherit the driver's environment on a cluster)."""
    return {k: os.environ[k] for k in PORTABLE if k in os.environ}
