"""rlcore.kernels.keep_freed_memory, which every compute process runs (rlcore.kernels.activate): memory a step frees is
kept in the heap for the next step's allocations instead of going back to the kernel, to be faulted in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from ..conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's allocator only")

# a fresh process: 20 MiB malloc'ed, written and freed; glibc's bytes free in its heap afterwards, and the page faults of
# taking 20 MiB again
PROBE = """
import ctypes, resource, sys
from rlcore.kernels import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                              "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "keep":
    assert keep_freed_memory()
size = 20 << 20
p = libc.malloc(size); ctypes.memset(p, 1, size); libc.free(ctypes.c_void_p(p))
free_bytes = libc.mallinfo2().fordblks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(size); ctypes.memset(p, 2, size)
print(free_bytes, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    free_bytes, faults = out.stdout.split()
    return int(free_bytes), int(faults)


def test_freed_blocks_stay_in_the_heap_and_are_taken_again_without_page_faults():
    kept_free, kept_faults = probe("keep")
    default_free, default_faults = probe("default")
    assert kept_free >= 20 << 20 and kept_faults < 100  # the 20 MiB reused as they are
    assert default_free < 1 << 20 and default_faults > 4000  # glibc's default: unmapped, 5,120 pages faulted again
