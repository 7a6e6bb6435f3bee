"""The allocators of alchemist.host_memory, each in a fresh process: glibc with keep_freed_memory reuses a freed
buffer without new page faults; under a load that fragments, it grows where jemalloc (the server's) stays flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from alchemist.host_memory import jemalloc_library

PAGES_PER_BUFFER = (64 << 20) // 4096  # 64 MiB buffers: above glibc's largest adaptive mmap threshold (32 MiB)

FAULTS_OF_FRESH_BUFFERS = """
import resource, sys, torch
import alchemist.engine  # noqa: F401  what a server process holds before it serves (torch's kernels set up)
from alchemist.host_memory import keep_freed_memory

def faults_of_five_buffers():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(16 << 20)  # 64 MiB of fp32, written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

if sys.argv[1] == "keep":
    assert keep_freed_memory()
    faults_of_five_buffers()  # the heap grows once
print(faults_of_five_buffers())
"""


def faults(mode: str) -> int:
    return int(subprocess.check_output([sys.executable, "-c", FAULTS_OF_FRESH_BUFFERS, mode], text=True))


def test_freed_buffers_are_reused_without_page_faults():
    default, kept = faults("default"), faults("keep")
    assert default > 0.9 * 5 * PAGES_PER_BUFFER  # glibc's default: every page of every buffer faults anew
    assert kept < 0.01 * default


# Records that live for a while (100 rounds here) beside temporaries of many sizes, as a server that records,
# serves and trains allocates: resident memory at every 40th round.
RSS_UNDER_FRAGMENTING_LOAD = """
import random, sys, torch
from collections import deque
from pathlib import Path
from alchemist.host_memory import keep_freed_memory

def rss_mb():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) >> 10

if sys.argv[1] == "keep":
    assert keep_freed_memory()
rng, records, samples = random.Random(0), deque(), []
for i in range(200):
    temporaries = [torch.ones(rng.randint(1 << 18, 10 << 20)) for _ in range(rng.randint(2, 12))]  # 1-40 MB
    records.append(torch.ones(rng.randint(1 << 17, 3 << 18)))  # 0.5-3 MB
    if len(records) > 100:
        records.popleft()
    del temporaries
    if i % 40 == 39:
        samples.append(rss_mb())
print(samples)
"""


def rss_under_fragmenting_load(mode: str, env: dict[str, str] | None = None) -> list[int]:
    command = [sys.executable, "-c", RSS_UNDER_FRAGMENTING_LOAD, mode]
    return json.loads(subprocess.check_output(command, text=True, env=os.environ | (env or {})))


def test_the_servers_allocator_stays_flat_where_kept_memory_grows():
    library = jemalloc_library()
    assert library is not None, "jemalloc is not installed: apt-get install libjemalloc2"
    kept = rss_under_fragmenting_load("keep")
    jemalloc = rss_under_fragmenting_load("jemalloc", {"LD_PRELOAD": library})
    # glibc keeping freed memory: the heap grows round after round (788 -> 1,062 MB on the machine of
    # docs/benchmarks.md, "Soak"); jemalloc levels off once the records' lifetime has passed (436 -> 450 MB).
    assert kept[-1] - kept[2] > 100
    assert abs(jemalloc[-1] - jemalloc[2]) < 40
