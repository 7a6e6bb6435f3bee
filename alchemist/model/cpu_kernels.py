"""Kernels of our own for the CPU, compiled from ``alchemist/model/csrc`` on first use and cached.

    op = decode_attention_op()   # torch.ops.alchemist.decode_attention, or None where it cannot be built
    op = packed_linear_op()      # torch.ops.alchemist.packed_linear (the compiled decode step's linear)

The build uses torch's C++ extension loader (a C++ compiler and ninja; gcc -O3 -march=native) into
``$ALCHEMIST_CACHE/kernels`` (default ``~/.cache/alchemist/kernels``), one directory per set of sources, torch version
and CPU flag set, so a cache dir shared by machines of different CPUs never loads a binary built for another
(``-march=native``). The first build takes seconds (docs/benchmarks.md, "Start-up"); later starts load the built
library. Where the build
fails (no compiler) the callers keep ATen's path and a warning says why.

Build it from the thread that will call it, before serving starts (``ModelRunner`` does): the build is a
compiler subprocess, but loading registers torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import cache
from pathlib import Path

import torch

from alchemist.model.cpu_features import cpu_flags
from alchemist.model.gguf import default_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


SOURCES = (CSRC / "decode_attention.cpp", CSRC / "packed_linear.cpp")


def _build_dir() -> tuple[str, Path]:
    key = hashlib.sha256()
    for source in SOURCES:
        key.update(source.read_bytes())
    key.update(" ".join(CFLAGS).encode())
    key.update(torch.__version__.encode())
    key.update(" ".join(sorted(cpu_flags())).encode())
    name = f"alchemist_kernels_{key.hexdigest()[:16]}"
    return name, default_cache_dir() / "kernels" / name


@cache
def _loaded() -> bool:
    """Builds (first use) or loads our kernels' library, which registers the ``torch.ops.alchemist`` ops; False if
    it cannot be built here or ``ALCHEMIST_NO_CPU_KERNELS`` is set (ATen's path then serves)."""
    if os.environ.get("ALCHEMIST_NO_CPU_KERNELS"):
        return False
    name, build_dir = _build_dir()
    try:
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: serve with ATen's kernels instead
        log.warning("the CPU kernels could not be built (%s: %s); using ATen's", type(e).__name__, e)
        return False
    # Their shapes for torch.compile's tracing (alchemist.engine.compiled_decode).
    torch.library.register_fake("alchemist::decode_attention")(
        lambda q, k, v, k_cache, v_cache, slots, positions, scale: torch.empty_like(q)
    )
    torch.library.register_fake("alchemist::packed_linear")(
        lambda x, weight, bias, out_features: x.new_empty(x.shape[0], out_features)
    )
    return True


def decode_attention_op():
    """``torch.ops.alchemist.decode_attention`` (``csrc/decode_attention.cpp``): decode attention over a bf16 or
    fp32 per-slot cache without copying it; None where our kernels cannot be built."""
    return torch.ops.alchemist.decode_attention if _loaded() else None


def packed_linear_op():
    """``torch.ops.alchemist.packed_linear`` (``csrc/packed_linear.cpp``): oneDNN's packed linear as an op the
    compiler keeps opaque; None where our kernels cannot be built."""
    return torch.ops.alchemist.packed_linear if _loaded() else None
