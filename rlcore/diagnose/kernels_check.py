"""The ``cpu kernels`` check: which kernels ``resources.cpu_kernels`` gives a run on this machine, and whether the
portable ones can be built here (a C++ compiler, once per machine). torch is imported inside the check only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlcore.diagnose.base import Check, Context, register
from rlcore.kernels import has_avx2


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def product_kernel(flags: set[str]) -> str:
    """The portable products' code this CPU runs (``csrc/portable_kernels.cpp`` picks the same way)."""
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


@register("kernels")
def check_kernels(ctx: Context) -> Check:
    mode = ctx.cfg.resources.cpu_kernels
    if mode == "native":
        import torch

        blas = "MKL" if torch.backends.mkl.is_available() else "torch's own BLAS"
        return Check("kernels", "ok", f"native: {blas} products and vector math, ATen's widest loops for this CPU "
                     f"(results match CPUs of this model only)")
    from rlcore.engine import portable_ops

    kernel = product_kernel(cpu_flags())
    detail = f"portable: products on rlcore's {kernel} code, ATen's AVX2 loops"
    if not has_avx2():
        detail = (f"portable: products on rlcore's {kernel} code; no AVX2 here, so ATen's loops are this CPU's own "
                  f"(results match CPUs of this kind only)")
    if portable_ops.library_path().is_file():
        return Check("kernels", "ok" if has_avx2() else "warn", detail + "; kernels built",
                     "" if has_avx2() else "for results that match other machines, run on an x86-64 CPU with AVX2")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return Check("kernels", "fail", detail + f"; not built yet, and no C++ compiler ({compiler}) to build them",
                     "install g++ (Debian/Ubuntu: apt-get install g++), or set resources.cpu_kernels: native")
    return Check("kernels", "ok", detail + f"; built by {compiler} on first use (about 20 s, once)")
