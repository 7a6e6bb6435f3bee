"""Compute ops whose linear layers use oneDNN-prepacked bf16 weights: the engine's fast path on CPU.

A stock ``F.linear`` on a bf16 CPU tensor re-lays-out the weight on every call; packing each base projection once
(``mkldnn._reorder_linear_weight``) and calling ``mkldnn._linear_pointwise`` skips that: faster matmuls and decode
steps on avx512_bf16 CPUs (docs/benchmarks.md, "Packed bf16 linears and oneDNN's primitive cache"). Outputs are
bitwise equal to ``F.linear`` in the cases tested (tests/engine/test_packed_ops.py checks the model end to end).

fp32 keeps the plain ``ComputeOps``: it is the exactness reference, and oneDNN's fp32 kernels round differently.
Base weights are frozen while serving (adapters are separate deltas), so packing once at start-up is safe.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from alchemist.model.llama import Llama
from alchemist.model.seam import LINEAR_NAMES, ComputeOps


def packed_linear_supported(model: Llama) -> bool:
    """True where the packed path applies: a bf16 model on a CPU whose oneDNN packs bf16 weights."""
    return model.device.type == "cpu" and model.dtype == torch.bfloat16 and onednn_packs_bf16()


@cache
def onednn_packs_bf16() -> bool:
    """Whether this torch and CPU pack bf16 linear weights: oneDNN's bf16 path needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and raises without them (an AMD Zen 3 here): tried once on a small weight."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        pack(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


# Rows are padded to a multiple of this. Note: oneDNN builds and keeps a primitive for every input shape it meets,
# and serving meets every row count from 1 to max_num_batched_tokens: resident memory grows by gigabytes before it
# levels off; padded, by a sixteenth as many primitives (docs/benchmarks.md, "Packed bf16 linears and oneDNN's
# primitive cache").
ROW_MULTIPLE = 16


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for a packed ``W``, rows padded to a multiple of ``ROW_MULTIPLE`` with zeros and cut
    off again: each row's product is computed on its own, so the rows kept are bitwise what ``x`` alone gives
    (tests/engine/test_packed_ops.py)."""
    rows = x.shape[0]
    pad = -rows % ROW_MULTIPLE
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if pad else out


class PackedLinearOps(ComputeOps):
    """``ComputeOps`` with every base projection's weight packed once.

    A subclass rather than a wrapper so that every other method of the seam (attention, layer hooks, and any the
    seam grows) stays the plain computation without being listed here.
    """

    def __init__(self, model: Llama) -> None:
        assert packed_linear_supported(model)
        self._packed = {
            (i, name): pack(getattr(layer, f"{name}_weight"))
            for i, layer in enumerate(model.layers)
            for name in LINEAR_NAMES
        }

    def linear(
        self, layer: int, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return packed_linear(x, self._packed[layer, name], bias)

    def linear_weight(self, layer: int, name: str, weight: torch.Tensor) -> torch.Tensor:
        return self._packed[layer, name]
