"""The process's memory allocator: jemalloc for the server where installed, else glibc told to keep freed memory.

Two needs pull apart. Recording wants freed memory reused: a record is hundreds of MiB of new buffers per long
prompt (`activations/record.py`), written once in the prefill, and a buffer on fresh pages costs a page fault and
the kernel's zeroing of each page on its first write. glibc serves large allocations with fresh pages from mmap
(above a threshold that adapts up to 32 MiB) and gives freed memory at its heap's top back to the OS; with its
defaults recording a prompt cost over ten times what it costs with ``keep_freed_memory``'s thresholds
(docs/benchmarks.md, "Host memory"). A server that trains under load wants the opposite: kept memory fragments
(records kept until trained, a training batch's temporaries, serving's, all of many sizes and lifetimes), and
glibc's heap grew by hundreds of MB a minute while the memory in use stayed level (2.0 GB in use, 3.0 GB of heap
after 5 minutes of the soak, still growing; ``malloc_trim`` after each batch gave the pages back for seconds only;
an mmap threshold of 8 MiB changed nothing: docs/benchmarks.md, "Soak"). jemalloc at its defaults keeps such a
load flat (its size classes do not fragment so, and it hands freed large buffers back), and costs recording page
faults again (a recorded 512-token prefill 22% slower than unrecorded, 1% with glibc keeping memory; tcmalloc
reused memory but still grew). The server chooses flat: ``alchemist serve`` starts itself again in place with
jemalloc preloaded where it is installed (Debian's ``libjemalloc2``; ``--allocator libc`` keeps glibc's), as vLLM's
CPU guide asks its users to preload tcmalloc by hand. Other commands (benchmarks, profiles) keep glibc's allocator
with ``keep_freed_memory``; memory probes that measure peaks by RSS run in fresh processes with glibc's defaults
(``alchemist.bench.memory_probe``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 1 << 30  # allocations below this come from the heap, whose freed memory is reused
# Free memory at the heap's top kept up to this much before it goes back to the OS: mallopt takes a C int, so 2 GiB.
TRIM_THRESHOLD_BYTES = 2**31 - 1


def _libc() -> ctypes.CDLL | None:
    path = ctypes.util.find_library("c")
    return None if path is None else ctypes.CDLL(path)


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds so that freed buffers are reused; False where the C library is not glibc."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mmap_set) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


# Set in the environment of the process started again with jemalloc: it is never started a third time.
STARTED_AGAIN = "ALCHEMIST_ALLOCATOR_PRELOADED"


def jemalloc_library() -> str | None:
    """jemalloc's shared library as the dynamic loader finds it (e.g. ``libjemalloc.so.2``), None where absent."""
    return ctypes.util.find_library("jemalloc")


def allocator_in_use() -> str:
    """"jemalloc" when jemalloc serves this process's malloc (preloaded), else "libc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "libc"
    return "jemalloc" if "libjemalloc" in maps else "libc"


def use_allocator(choice: str) -> str:
    """Makes ``choice`` ("auto", "jemalloc", "libc") this process's allocator before it allocates much: for jemalloc
    where it is not yet loaded, runs this command again in place (same process id, arguments and environment, plus
    LD_PRELOAD) and does not return; "auto" means jemalloc where installed. Returns the allocator in use. Raises
    ValueError for "jemalloc" where it is not installed."""
    in_use = allocator_in_use()
    library = jemalloc_library()
    if choice == "libc" or in_use == "jemalloc" or not sys.platform.startswith("linux"):
        return in_use
    if library is None:
        if choice == "jemalloc":
            raise ValueError("--allocator jemalloc: jemalloc is not installed (Debian: apt-get install libjemalloc2)")
        logger.warning("jemalloc is not installed: glibc's allocator serves, and a server that trains grows its "
                       "resident memory under load (apt-get install libjemalloc2; see alchemist/host_memory.py)")
        return in_use
    if os.environ.get(STARTED_AGAIN):
        logger.warning("jemalloc could not be preloaded (%s): glibc's allocator serves", library)
        return in_use
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD")]))
    # jemalloc at its defaults: told to keep freed pages, as glibc is, it grew as glibc's heap did.
    os.execve(sys.executable, sys.orig_argv, os.environ | {"LD_PRELOAD": preload, STARTED_AGAIN: "1"})
    raise AssertionError("unreachable")
