"""This machine: a description, the package versions, and its fp32 matmul rate (the MFU ceiling).

    .venv/bin/python -m bench.machine
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata

import psutil
import torch

PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "ray", "psutil", "py-spy", "rlcore")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe() -> dict[str, str]:
    return {
        "cpu": f"{cpu_model()}, {os.cpu_count()} logical cores",
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpu": "none (CPU only)",
    }


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def matmul_flops(n: int = 1024, threads: int | None = None, seconds: float = 2.0) -> float:
    """Best-of-repeats fp32 GEMM rate (FLOP/s) with ``threads`` torch threads (default: all cores)."""
    return gemm_flops(n, n, n, threads=threads, seconds=seconds)


def gemm_flops(m: int, k: int, n: int, *, transposed: bool = False, threads: int | None = None,
               seconds: float = 2.0) -> float:
    """Best-of-repeats fp32 rate (FLOP/s) of ``[m, k] @ [k, n]`` with ``threads`` torch threads (default: all
    cores); ``transposed``: ``[k, m]^T @ [k, n]`` (a weight gradient's product, its inner dimension the tokens)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        a = torch.randn(k, m).t() if transposed else torch.randn(m, k)
        b = torch.randn(k, n)
        torch.mm(a, b)  # warm-up
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return 2 * m * k * n / best
    finally:
        torch.set_num_threads(old)


def memory_bandwidth(mib: int = 256, threads: int | None = None, seconds: float = 2.0) -> float:
    """Best-of-repeats bytes/s of copying a ``mib`` MiB fp32 tensor (bytes read + bytes written), far larger
    than the caches: the ceiling for a decode step that streams its weights and KV cache."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        a = torch.randn(mib * 2**20 // 4)
        b = torch.empty_like(a)
        b.copy_(a)  # warm-up (pages touched)
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - start)
        return 2 * a.numel() * 4 / best
    finally:
        torch.set_num_threads(old)


if __name__ == "__main__":
    print(describe(), versions(), f"{matmul_flops() / 1e9:.0f} GFLOP/s", f"{memory_bandwidth() / 1e9:.1f} GB/s",
          sep="\n")
