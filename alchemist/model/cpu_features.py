"""What this CPU runs fast, read once from /proc/cpuinfo (False where it cannot be read)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()[2:])


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast on CPUs with AVX512-BF16 or AMX (several times fp32's: docs/benchmarks.md, "Decode
    attention in bf16 without AMX")."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx_bf16() -> bool:
    """AMX tiles for bf16: where ATen's CPU flash-attention kernels run bf16 at speed (without them, a one-query
    bf16 call ran several times slower than the fp32 kernel on fp32 copies: docs/benchmarks.md, "Decode attention in
    bf16 without AMX")."""
    return "amx_bf16" in cpu_flags()
