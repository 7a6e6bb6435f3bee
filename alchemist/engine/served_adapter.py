"""The LoRA adapter as the engine serves it: a frozen copy, laid out for a fast delta.

``ServedAdapter(adapter, model_dtype, device)`` copies the adapter's A and B (``LoraAdapter.module_tensors``, so
PEFT's per-module view): the trainer may go on updating its own adapter in place, and what is served never
changes. Per layer and fused projection it keeps ``scaling * A^T`` (in, parts*r) and one block-diagonal ``B^T``
(parts*r, fused out; zero blocks where a part is not targeted), so a delta is two matmuls instead of one per part,
a scaling and a concatenation: ``delta = (x @ (scaling * A^T)) @ B^T``, the sum ``LoraAdapter.delta`` computes
(rounded differently: in fp32 they agree to about 1e-7 of the delta's magnitude, not bitwise).

The delta is computed in fp32 (the adapter's master precision) even for a bf16 model, and cast to the model's
dtype at the end: on this CPU a bf16 matmul of these small shapes costs about 30 us whatever its size (oneDNN's
fixed cost), an fp32 one 2-7 us. Serving a bf16 copy of the ``LoraAdapter`` itself added 24-34 ms to a decode step
of SmolLM2 (1 thread, batch 1 and 8); this layout adds 8-17 ms (docs/architecture.md). That is what a recording
forward pays; every other forward serves the adapter merged into the weights (``merged_weight``,
``alchemist.engine.merged_adapter``) and pays nothing.
"""

from __future__ import annotations

import torch

from alchemist.model.lora import FUSED_PARTS, LoraAdapter, part_shapes


class ServedAdapter:
    def __init__(self, adapter: LoraAdapter, model_dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype = torch.promote_types(model_dtype, torch.float32)  # fp64 models (tests) keep fp64
        r, scaling = adapter.config.r, adapter.config.scaling
        shapes = part_shapes(adapter.model_config)
        tensors = adapter.module_tensors()  # (layer, PEFT module, "A" | "B") -> (r, in) | (out, r), views
        self._weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for layer in range(adapter.model_config.num_layers):
                for fused, parts in FUSED_PARTS.items():
                    targeted = adapter.targeted(fused)
                    if not targeted:
                        continue
                    a = torch.cat([tensors[layer, part, "A"] for part in targeted])  # (parts*r, in): a new tensor
                    b = torch.zeros(len(targeted) * r, sum(shapes[part][1] for part in parts), device=a.device)
                    col = 0
                    for part in parts:
                        width = shapes[part][1]
                        if part in targeted:
                            j = targeted.index(part)
                            b[j * r : (j + 1) * r, col : col + width] = tensors[layer, part, "B"].t()
                        col += width
                    at = (a.t() * scaling).to(device=device, dtype=self.dtype).contiguous()  # (in, parts*r)
                    self._weights[layer, fused] = (at, b.to(device=device, dtype=self.dtype))

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """Low-rank delta for the fused projection ``name`` on input x (T, in) -> (T, fused out), in x's dtype."""
        weights = self._weights.get((layer, name))
        if weights is None:
            return None
        at, bt = weights
        return torch.mm(torch.mm(x.to(self.dtype), at), bt).to(x.dtype)  # (T, in) @ (in, parts*r) @ (parts*r, out)

    def merged_weight(self, layer: int, name: str, base: torch.Tensor) -> torch.Tensor | None:
        """The fused projection's weight with the delta folded in, ``base + (A^T B^T)^T`` (out, in), computed in
        fp32 and rounded once to ``base``'s dtype; None if the adapter does not target the projection."""
        weights = self._weights.get((layer, name))
        if weights is None:
            return None
        at, bt = weights
        return torch.addmm(base.to(self.dtype), bt.t(), at.t()).to(base.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor served (tests check they are the engine's own)."""
        return [t for pair in self._weights.values() for t in pair]
