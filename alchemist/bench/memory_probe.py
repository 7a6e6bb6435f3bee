"""Transient peak memory of one call, measured on CPU the way shared/design/activation-reuse.md (section 10) says.

``transient_peak_mib(fn)`` is VmHWM after ``fn`` minus VmRSS before it, with the high-water mark reset first. It is
only meaningful where glibc returns freed large buffers to the OS (``MALLOC_MMAP_THRESHOLD_``), so that RSS tracks
live memory: ``in_fresh_process`` runs a probe function in a new Python process with that setting and returns what
it returns (JSON). Timing runs without it: unmapping every freed buffer slows the steps down.

    peak = in_fresh_process("alchemist.bench.training:memory_probe", "replay", 1024, 128, None, "float32")
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def rss_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def transient_peak_mib(fn: Callable[[], object]) -> float:
    """Peak RSS above the RSS before ``fn`` (needs MALLOC_MMAP_THRESHOLD_ so that freed buffers leave RSS)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = rss_kib("VmRSS")
    fn()
    return (rss_kib("VmHWM") - before) / 1024


def in_fresh_process(target: str, *args: Any) -> Any:
    """Calls ``target`` ("package.module:function") with ``args`` (JSON-able) in a fresh Python process with
    ``MALLOC_ENV``, and returns its result (JSON-able). Its stderr is raised with the error if it fails."""
    module, function = target.split(":")
    code = f"import sys, json; from {module} import {function}; print(json.dumps({function}(*json.loads(sys.argv[1]))))"
    env = {**os.environ, **MALLOC_ENV}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {target}{tuple(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
