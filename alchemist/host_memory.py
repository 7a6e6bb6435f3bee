"""Host memory reuse: keep freed memory in the process instead of handing it back to the OS.

glibc serves a large allocation (above a threshold that adapts up to 32 MiB) with fresh pages from mmap, and gives
freed memory at the top of its heap back to the OS. Every new buffer of that size then costs a page fault and the
kernel's zeroing of each page on its first write. Recording hits this hardest: a record is hundreds of MiB of new
buffers per long prompt (`activations/record.py`), written once in the prefill: with glibc's defaults recording
cost over ten times what it costs with the thresholds below (docs/benchmarks.md, "Host memory: glibc's
thresholds"). vLLM's and IPEX's CPU guides
get the same effect from tcmalloc or jemalloc by LD_PRELOAD; here glibc's own ``mallopt`` does it, with nothing to
install.

The process that owns the allocator decides: the CLI calls ``keep_freed_memory()`` once at start (the server, the
benchmarks). Memory probes that measure peaks by RSS run in fresh processes with the opposite setting
(``alchemist.bench.memory_probe``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 1 << 30  # allocations below this come from the heap, whose freed memory is reused
# Free memory at the heap's top kept up to this much before it goes back to the OS: mallopt takes a C int, so 2 GiB.
TRIM_THRESHOLD_BYTES = 2**31 - 1


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds so that freed buffers are reused; False where the C library is not glibc."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mmap_set) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
