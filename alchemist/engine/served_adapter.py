"""The LoRA adapter as the engine serves it: a frozen copy, laid out for a fast delta.

``ServedAdapter(adapter, model_dtype, device)`` copies the adapter's A and B (``LoraAdapter.module_tensors``, so
PEFT's per-module view): the trainer may go on updating its own adapter in place, and what is served never
changes. Per layer and fused projection it keeps ``scaling * A^T`` (in, parts*r) and one block-diagonal ``B^T``
(parts*r, fused out; zero blocks where a part is not targeted), so a delta is two matmuls instead of one per part,
a scaling and a concatenation: ``delta = (x @ (scaling * A^T)) @ B^T``, the sum ``LoraAdapter.delta`` computes
(rounded differently: in fp32 they agree to about 1e-7 of the delta's magnitude, not bitwise).

For a bf16 model the delta's dtype depends on the rows: below ``FP32_MAX_ROWS`` rows (a decode step) it is
computed in fp32 (the adapter's master precision) and cast to the model's dtype at the end, because a bf16 matmul
of these small shapes costs oneDNN's fixed cost whatever its size, several times an fp32 one's: serving a bf16
copy of the ``LoraAdapter`` itself cost a decode step two to three times what this layout costs. From ``FP32_MAX_ROWS``
rows on (a prefill chunk) it is computed in bf16, like PEFT's (fp32 accumulation, xa and the delta rounded to bf16:
the delta, not the output, loses about 2^-8 of itself): there the fp32 delta's (T, out) products cost the most,
and a recording prefill step pays less over the base model's with the bf16 delta than with the fp32 one (figures:
docs/benchmarks.md, "Serving an adapter: the delta's dtype and the merge"). That is what a recording forward pays;
every other forward serves the adapter merged into the weights (``merged_weight``,
``alchemist.engine.merged_adapter``) and pays nothing.
"""

from __future__ import annotations

import torch

from alchemist.engine.router import Router
from alchemist.model.lora import FUSED_PARTS, LoraAdapter, part_shapes

# From this many rows a bf16 model's delta runs in bf16: SmolLM2's fused deltas cost the same in both dtypes at 32
# rows, less in fp32 below, less in bf16 above (``python docs/profiles/adapter_prefill.py``, its last lines;
# docs/benchmarks.md, "Serving an adapter: the delta's dtype and the merge").
FP32_MAX_ROWS = 32


class ServedAdapter:
    def __init__(self, adapter: LoraAdapter, model_dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype = torch.promote_types(model_dtype, torch.float32)  # fp64 models (tests) keep fp64
        self.device = torch.device(device)
        r, scaling = adapter.config.r, adapter.config.scaling
        self.r = r
        self.targeted = {fused: adapter.targeted(fused) for fused in FUSED_PARTS}  # the parts of each, in order
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
        # The corrections' ranks, cut (LoraAdapter.cut: the first ``cut`` of each part): they act only on the rows of
        # routed requests from the last prompt token on (``delta``'s ``unscoped``, ``answer_delta``) and are left out
        # of the merge. Per fused projection: which columns of ``scaling * A^T`` (rows of ``B^T``) are theirs.
        self.cut = adapter.cut
        self.taught = [list(p) for p in adapter.taught]  # the prompts they were taught on (alchemist.engine.router)
        self.router: Router | None = None  # made from them by the engine (it knows the tokenizer), off serving's time
        self._cut: dict[tuple[int, str], torch.Tensor] = {}
        if self.cut:
            for key, (at, _) in self._weights.items():
                cols = torch.zeros(at.shape[1] // r, r, dtype=torch.bool, device=at.device)
                cols[:, : self.cut] = True
                self._cut[key] = cols.flatten()
        # the same in the model's dtype, for deltas of many rows (none for an fp32 or fp64 model)
        self._low = {} if model_dtype == self.dtype else {
            key: (at.to(model_dtype), bt.to(model_dtype)) for key, (at, bt) in self._weights.items()}  # fmt: skip

    def delta(
        self, layer: int, name: str, x: torch.Tensor, unscoped: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Low-rank delta for the fused projection ``name`` on input x (T, in) -> (T, fused out), in x's dtype; the
        cut ranks left out on the rows ``unscoped`` (a (T,) bool mask) marks."""
        weights = self._weights.get((layer, name))
        if weights is None:
            return None
        if self._low and x.shape[0] >= FP32_MAX_ROWS:
            weights = self._low[layer, name]
        at, bt = weights
        xa = torch.mm(x.to(at.dtype), at)  # (T, in) @ (in, parts*r)
        if self.cut and unscoped is not None:
            xa.masked_fill_(unscoped[:, None] & self._cut[layer, name], 0)
        return torch.mm(xa, bt).to(x.dtype)  # @ (parts*r, out)

    def answer_delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The cut ranks' delta alone on x (T, in) -> (T, fused out), in x's dtype (computed in fp32): what rows
        served by the merge (which leaves them out) add where they are in scope."""
        weights = self._weights.get((layer, name))
        if weights is None:
            return None
        at, bt = weights
        cols = self._cut[layer, name]
        return torch.mm(torch.mm(x.to(at.dtype), at[:, cols]), bt[cols]).to(x.dtype)

    def fused(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused projection's ``scaling * A^T`` (in, parts*r) and ``B^T`` (parts*r, out), fp32 (the delta's own
        copies: read, never change); None if the adapter does not target it."""
        return self._weights.get((layer, name))

    def cut_columns(self, layer: int, name: str) -> torch.Tensor | None:
        """Which of the fused projection's parts*r columns of ``scaling * A^T`` are cut ranks (parts*r,) bool; None
        where the adapter has none there."""
        return self._cut.get((layer, name))

    def merged_weight(self, layer: int, name: str, base: torch.Tensor) -> torch.Tensor | None:
        """The fused projection's weight with the delta folded in, ``base + (A^T B^T)^T`` (out, in), computed in
        fp32 and rounded once to ``base``'s dtype; None if the adapter does not target the projection."""
        weights = self._weights.get((layer, name))
        if weights is None:
            return None
        at, bt = weights
        if self.cut:  # the cut ranks are added per row (``answer_delta``)
            keep = ~self._cut[layer, name]
            at, bt = at[:, keep], bt[keep]
        return torch.addmm(base.to(self.dtype), bt.t(), at.t()).to(base.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor served (tests check they are the engine's own)."""
        return [t for weights in (self._weights, self._low) for pair in weights.values() for t in pair]


class RowScope:
    """A served adapter as ``Llama.project`` reads it for one batch of ``num_rows`` rows: its cut ranks only on the
    ``answer`` rows (indices: the rows of routed requests from their last prompt token on)."""

    def __init__(self, adapter: ServedAdapter, answer: list[int], num_rows: int) -> None:
        self.adapter = adapter
        self.unscoped = torch.ones(num_rows, dtype=torch.bool, device=adapter.device)
        self.unscoped[answer] = False

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        return self.adapter.delta(layer, name, x, self.unscoped)


class AnswerRows:
    """Beside the merged weights (the cut ranks left out): the cut ranks' delta on the ``rows`` (indices) alone."""

    def __init__(self, adapter: ServedAdapter, rows: torch.Tensor) -> None:
        self.adapter, self.rows = adapter, rows

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        part = self.adapter.answer_delta(layer, name, x[self.rows])
        if part is None:
            return None
        return x.new_zeros(x.shape[0], part.shape[1]).index_copy_(0, self.rows, part)
