"""keep_freed_memory: a buffer freed and allocated again costs no new page faults (a fresh process each time)."""

from __future__ import annotations

import subprocess
import sys

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
