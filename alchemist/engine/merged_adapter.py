"""The served adapter folded into the base weights, so that a forward that records nothing pays nothing for it.

Serving a LoRA adapter as a separate delta costs every forward two small matmuls per fused projection: 120 per
SmolLM2 forward, a sixth to a fifth of a bf16 decode step here (docs/benchmarks.md, "Serving an adapter: the delta's
dtype and the merge"). A single served
adapter can instead be merged, as PEFT's ``merge_and_unload`` does: per fused projection ``W' = W + scaling * B A``
(``ServedAdapter.merged_weight``, computed in fp32 and rounded once to the model's dtype), packed for oneDNN where
the base weights are (``alchemist.engine.packed_ops``). ``MergedLinearOps`` is then the seam for forwards that
record nothing, which decode always is: it projects with ``W'`` and the model adds no delta.

A recording forward keeps the base weights and the separate delta, because a record holds base outputs (the replay
adds the delta of the adapter it trains, ``alchemist.training.replay``). The two forms agree to the rounding of
``W'`` to the model's dtype (bitwise in neither fp32 nor bf16; tests/engine/test_merged_adapter.py bounds it).

Merging is spread over engine steps, one layer per step (``merge_next``; a whole model's merge is longer than a
decode step: docs/benchmarks.md, same section): until every layer is merged the engine serves the separate
delta, so a swap never stalls serving. The online trainer does better: it makes the merge in its own slices, a layer
each, while the previous adapter serves, and swaps in the complete merge (``LLMEngine.set_adapter_slices``), so a
publish costs serving neither the merge nor the separate delta's forwards. Memory: one merged copy of the targeted
projections (for SmolLM2 in bf16, 212 MB; two while a merge is made in slices), freed with the adapter it was made
from; ``EngineConfig.merge_adapter`` turns merging off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alchemist.engine.packed_ops import pack, packed_linear
from alchemist.engine.served_adapter import ServedAdapter
from alchemist.model.llama import Llama
from alchemist.model.seam import LINEAR_NAMES, ComputeOps, Ops


class MergedLinearOps(ComputeOps):
    """The seam with the served adapter merged into the targeted projections; ``base`` computes the others (and
    is what a forward uses until ``complete``)."""

    def __init__(self, model: Llama, adapter: ServedAdapter, base: Ops, packed: bool) -> None:
        self.model, self.adapter, self.base, self.packed = model, adapter, base, packed
        self._weights: dict[tuple[int, str], torch.Tensor] = {}
        self.num_merged = 0  # layers merged so far (layers 0 .. num_merged - 1)

    @property
    def complete(self) -> bool:
        return self.num_merged == self.model.config.num_layers

    @torch.no_grad()
    def merge_next(self) -> None:
        """Merges the next layer's targeted projections (a no-op once complete)."""
        if self.complete:
            return
        layer = self.num_merged
        # Normal tensors, never inference tensors, whichever mode the caller is in (a step, or the trainer's slice):
        # the compiled decode step guards on a weight's dispatch keys, and the base weights are normal tensors.
        with torch.inference_mode(False):
            for name in LINEAR_NAMES:
                merged = self.adapter.merged_weight(layer, name, getattr(self.model.layers[layer], f"{name}_weight"))
                if merged is not None:
                    self._weights[layer, name] = pack(merged) if self.packed else merged
        self.num_merged += 1

    def linear(
        self, layer: int, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        merged = self._weights.get((layer, name))
        if merged is None:  # a projection the adapter does not target
            return self.base.linear(layer, name, x, weight, bias)
        return packed_linear(x, merged, bias) if self.packed else F.linear(x, merged, bias)

    def linear_weight(self, layer: int, name: str, weight: torch.Tensor) -> torch.Tensor:
        merged = self._weights.get((layer, name))
        return self.base.linear_weight(layer, name, weight) if merged is None else merged
