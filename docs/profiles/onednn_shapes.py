"""Resident memory of bf16 matmuls over many row counts: oneDNN keeps a primitive per shape (docs/benchmarks.md,
"Soak", point 1). One thread; prints RSS (MB) after each pass over the row counts.

    python docs/profiles/onednn_shapes.py packed 1 2     # four packed projections, rows 1..512, unpadded: 2 passes
    python docs/profiles/onednn_shapes.py packed 16 2    # the same, rows padded to a multiple of 16 (as served)
    python docs/profiles/onednn_shapes.py linear 1 3     # F.linear of two weights, rows 1..2048 step 3: 3 passes
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from alchemist.engine.packed_ops import pack


def rss_mb() -> int:
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))


def main(kind: str, multiple: int, passes: int) -> None:
    torch.set_num_threads(1)
    if kind == "packed":  # SmolLM2's qkv, o, gate_up, down
        shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))
        weights = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in shapes]
        ops = [lambda x, p=pack(w): torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for w in weights]
        rows = range(1, 513)
    else:
        weights = [torch.randn(1536, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)]
        ops = [lambda x, w=w: F.linear(x, w) for w in weights]
        rows = range(1, 2049, 3)
    print("start", rss_mb(), flush=True)
    for i in range(passes):
        for m in rows:
            padded = -(-m // multiple) * multiple
            for w, op in zip(weights, ops, strict=True):
                op(torch.randn(padded, w.shape[1], dtype=torch.bfloat16))
        print("pass", i, rss_mb(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
