"""Peak memory of one phase of a worker's work (generation, reference forward, update), measured in the process.

On a GPU, the CUDA caching allocator's peak of allocated bytes (``torch.cuda.max_memory_allocated``, reset at the
phase's start). On a CPU, the process's peak resident set (``VmHWM`` of ``/proc/self/status``), which Linux resets
to the current resident set when ``5`` is written to ``/proc/self/clear_refs``: the phase's peak is then exact,
whatever ran before it, and includes everything the process holds (the runtime, the models, the optimizer state).
Where the reset is not permitted the figure is the process's peak so far (never less than the phase's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

MIB = 2**20


def _reset_cpu() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _hwm_bytes() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _reset_cpu()


def peak_bytes(device: torch.device) -> float:
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else _hwm_bytes()


@contextmanager
def phase(store: dict[str, float], name: str, device: torch.device) -> Iterator[None]:
    """Record the peak memory of what runs inside as ``store["perf/peak_mem_{name}_mib"]`` (the larger, if the phase
    ran more than once since ``store`` was emptied)."""
    reset(device)
    try:
        yield
    finally:
        key = f"perf/peak_mem_{name}_mib"
        store[key] = max(store.get(key, 0.0), peak_bytes(device) / MIB)
