"""Profile hook (not a benchmark): glibc's heap as an `alchemist serve` process sees it, every 5 s, into $HEAP_WATCH.

    HEAP_WATCH=/tmp/heap.log PYTHONPATH=docs/profiles/heap_watch:. alchemist bench soak --runs on ...

Python imports ``sitecustomize`` at start-up from the path; in a ``python -m alchemist.cli serve`` process this one
starts a thread that appends a line per sample: seconds since start, glibc's ``mallinfo2`` in MiB (``heap``: memory
the arenas hold; ``used``: allocated in them; ``free``: held but free; ``mmap``: mmap'd chunks) and VmRSS / RssAnon in
KiB. Under jemalloc (the server's allocator where installed) glibc's figures say nothing; RSS still does. What it
showed: docs/benchmarks.md, "Soak".
"""

import ctypes
import os
import sys
import threading
import time

PATH = os.environ.get("HEAP_WATCH")


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _watch() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    t0 = time.time()
    with open(PATH, "a") as out:
        while True:
            m = libc.mallinfo2()
            with open("/proc/self/status") as status:
                rss = {k: v.split()[0] for k, _, v in (line.partition(":") for line in status)
                       if k in ("VmRSS", "RssAnon")}
            out.write(f"{time.time() - t0:.0f} heap={m.arena >> 20} used={m.uordblks >> 20} free={m.fordblks >> 20} "
                      f"mmap={m.hblkhd >> 20} rss_kb={rss['VmRSS']} anon_kb={rss['RssAnon']}\n")
            out.flush()
            time.sleep(5)


if PATH and sys.orig_argv[1:4] == ["-m", "alchemist.cli", "serve"]:
    threading.Thread(target=_watch, name="heap-watch", daemon=True).start()
