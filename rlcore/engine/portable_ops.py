"""The portable kernels: torch's CPU operators whose results would depend on the CPU, computed so that they do not
(``resources.cpu_kernels: portable``; :mod:`rlcore.kernels` chooses, this module installs).

What depends on the CPU in a float32 training or generation step is MKL, which chooses its code by the CPU it
runs on, for two families of torch's CPU operators:

* the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``, ``dot``: every linear layer's
  forward and both backward products, attention's batched products, the decode's small products), and the
  products inside the fused CPU attention kernel;
* its vector math behind ``exp``, ``log``, ``sqrt``, ``tanh``, ``log2``, ``log10`` and the inverse trigonometric
  functions (AdamW's ``sqrt``, the PPO ratio's ``exp``, ``logsumexp``).

MKL's reproducibility setting (``MKL_CBWR=COMPATIBLE``) did not make them CPU-independent in practice (the same
commit's SFT model differed after its first optimizer step between an AMD EPYC and an Intel Xeon, both so set:
AdamW's ``sqrt`` and the products are the only MKL calls of that step), and it ran the products at a quarter of
MKL's own speed. So, in a process where :func:`install` ran, torch's dispatcher sends those operators on CPU
tensors elsewhere:

* the products to rlcore's own kernels (``csrc/portable_kernels.cpp``, compiled for the installed
  torch on first use and cached): every element of a product is one fused multiply-add chain over the summed
  dimension, in order, so AVX-512, AVX2 and scalar code give the same bits, whatever the blocking, the thread
  count, or the other rows in the call; ``sqrt`` is the CPU's own, exact (IEEE 754) everywhere;
* ``exp``, ``log``, ``tanh`` and the rest to SLEEF's AVX2 functions, the copy inside torch's own library that
  torch's AVX2 loops use (the same code on every CPU with AVX2; torch is pinned to one release).

The decoder's SwiGLU (``silu(gate) * up``) and rotary embedding take one fused pass each way
(:mod:`rlcore.engine.fused`), with the bits of torch's own AVX2 loops. Everything else stays with torch's own ATen loops: AVX2 builds on every CPU
(``ATEN_CPU_CAPABILITY=avx2``), on one thread (their parallel reductions split by thread count).
``scaled_dot_product_attention`` takes its math path (products and a softmax) instead of the fused CPU kernel.
bfloat16 and float16 products are computed in float32 and rounded once. CUDA tensors are not affected.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rlcore import cache
from rlcore.errors import ConfigError

SOURCE = Path(__file__).with_name("csrc") / "portable_kernels.cpp"
ISAS = ("scalar", "avx2", "avx512")
"""The product kernels, by the index the extension takes (a CPU runs the best it has unless told a lower one)."""
ISA_ENV = "RLCORE_PORTABLE_ISA"
"""A lower product kernel for every process (``avx2``, ``scalar``): the same bits, slower; for showing just that."""

_state: dict[str, object] = {}


def library_path() -> Path:
    """Where the compiled kernels for this torch and this source live (rlcore's cache)."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    return cache.root() / "kernels" / f"portable_kernels-{key}.so"


def build() -> Path:
    """Compile the kernels (g++, against the installed torch) unless already built; safe when several processes
    start at once (one compiles under a lock, the others wait and load its result). About 15-30 s, once."""
    target = library_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        # only when building: torch's extension machinery loads setuptools, which loading the kernels never needs
        from torch.utils.cpp_extension import include_paths, library_paths

        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            raise ConfigError(f"resources.cpu_kernels portable: rlcore's kernels are built on first use and need a C++ "
                              f"compiler, and {compiler!r} is not on PATH; install one (Debian/Ubuntu: apt-get install "
                              f"g++) or set resources.cpu_kernels: native")
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = [compiler, "-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", str(SOURCE), "-o", str(tmp)]
        cmd += [f"-I{p}" for p in include_paths()] + [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building rlcore's portable kernels failed ({' '.join(cmd[:2])} ...):\n{done.stderr}")
        tmp.replace(target)
    return target


ELEMENTWISE = ("exp", "log", "tanh", "log2", "log10", "tan", "atan", "asin", "acos", "erf", "sqrt")
"""torch's operators that MKL's vector math computes on a CPU, computed here by SLEEF's AVX2 functions (``sqrt``: the
CPU's own, exact)."""


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: torch's C++ side warns there (not through Python) when a library overrides
    one of its kernels."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def install(threads: int = 1, isa: str | None = None) -> str:
    """Route this process's CPU operators listed above to the portable kernels (building them first if needed),
    with ``threads`` threads sharing a product's rows; torch's own operators run on one thread. ``isa`` runs a
    lower product kernel than the CPU's best (``scalar``, ``avx2``; the same bits, slower: for checks). Idempotent:
    a later call changes only the threads and the kernel. Returns the product kernel in use."""
    if "library" not in _state:
        path = build()
        with warnings.catch_warnings(), _quiet_stderr():  # "Overriding a previously registered kernel": the point
            warnings.simplefilter("ignore")
            torch.ops.load_library(str(path))
        _state["library"] = path
    torch.set_num_threads(1)
    torch.backends.cuda.enable_flash_sdp(False)  # the CPU's fused attention kernel too (MKL inside): math path
    torch.ops.rlcore_portable.set_threads(max(1, int(threads)))
    isa = isa or os.environ.get(ISA_ENV) or ISAS[-1]
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISAS)}")
    chosen = torch.ops.rlcore_portable.set_isa(ISAS.index(isa))
    return ISAS[chosen]


def installed() -> bool:
    return "library" in _state


if __name__ == "__main__":  # make setup: build the kernels once, before the first stage or test needs them
    print(f"rlcore portable kernels: {build()}")
