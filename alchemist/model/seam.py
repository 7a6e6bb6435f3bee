"""The seam: every expensive operation of the model goes through one small ops object.

The model calls ``ops.linear`` for each base projection (fused ``qkv``, ``o``, fused ``gate_up``, ``down``),
``ops.attention`` for each attention call, and ``ops.layer_input`` with each layer's input hidden state (the
layer walk of the replay trainer starts each layer from it). ``ComputeOps`` just computes. Recording (serving
prefill) and replay (training) are other ops objects with the same methods: they see every output the model
computes, per layer and by name, which is exactly what activation reuse needs (shared/design/activation-reuse.md,
section 2).

Names of the base projections as the seam sees them; LoRA targets use the per-projection names of PEFT
(q_proj, k_proj, ...), which map onto these fused outputs.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from alchemist.model.attention import AttentionMetadata, attend

LINEAR_NAMES = ("qkv", "o", "gate_up", "down")


class Ops(Protocol):
    def layer_input(self, layer: int, h: torch.Tensor) -> None: ...

    def linear(
        self, layer: int, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...


class ComputeOps:
    """Plain computation: what serving decode and the recompute trainer use."""

    def layer_input(self, layer: int, h: torch.Tensor) -> None:
        pass

    def linear(
        self, layer: int, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def linear_weight(self, layer: int, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight ``linear`` multiplies by in place of the model's ``weight``, in its own layout (the compiled
        decode step takes it as an input: ``alchemist.engine.compiled_decode``)."""
        return weight

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return attend(layer, q, k, v, meta).out


COMPUTE = ComputeOps()
