"""Reload or recompute: where the replay walk gets each prompt layer's recorded outputs from.

A record that went down to host memory or disk costs a copy per layer to bring back; the layer's outputs can also
be recomputed from its recorded input ``h`` (a prefill of that one layer: its q/k/v, attention, o and gate/up).
Per record and layer, ``plan`` picks the cheaper from a ``CostModel`` fed by measured numbers: the read bandwidth
of each tier and the compute time per prompt row of recomputing and of walking a layer, each updated with every
read and layer the trainer does. Reads run on the prefetch thread (``alchemist.training.layer_window``) while the
walk computes, so the plan simulates both timelines in the walk's order (top layer first): a layer is reloaded
when the reader can bring it no later than the walk could recompute it, else recomputed by the walk itself (and
the reader only fetches its small input). Both then finish at about the same time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from alchemist.model.attention import AttentionMetadata, attend
from alchemist.model.llama import Llama, rms_norm
from alchemist.model.lora import LoraAdapter
from alchemist.model.rope import Rotation
from alchemist.model.seam import COMPUTE
from alchemist.training.rank_split import Scoped

SMOOTHING = 0.3  # weight of a new observation in each running estimate


@dataclass
class CostModel:
    """Running estimates (exponential moving averages) of the speeds a plan is made from."""

    read_bytes_per_s: dict[str, float] = field(default_factory=dict)  # tier -> read bandwidth
    walk_s_per_row: float | None = None  # one layer of the walk, per row it differentiates (prompt and live)
    recompute_s_per_row: float | None = None  # one layer's outputs recomputed from its input, per prompt row

    def observe_read(self, tier: str, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            self.read_bytes_per_s[tier] = _smooth(self.read_bytes_per_s.get(tier), num_bytes / seconds)

    def observe_walk(self, rows: int, seconds: float) -> None:
        if rows:
            self.walk_s_per_row = _smooth(self.walk_s_per_row, seconds / rows)

    def observe_recompute(self, rows: int, seconds: float) -> None:
        if rows:
            self.recompute_s_per_row = _smooth(self.recompute_s_per_row, seconds / rows)

    def read_s(self, tier: str, num_bytes: int) -> float:
        """Seconds to read ``num_bytes`` from ``tier``; 0 until a read of that tier was measured (optimistic:
        reloading is what measures it)."""
        bandwidth = self.read_bytes_per_s.get(tier)
        return num_bytes / bandwidth if bandwidth else 0.0

    def recompute_s(self, rows: int) -> float:
        """Until a recomputation was measured: half a walk layer (a layer's forward is about half its backward
        here; design note, section 5), or infinite before anything was measured."""
        if self.recompute_s_per_row is not None:
            return rows * self.recompute_s_per_row
        return rows * self.walk_s_per_row / 2 if self.walk_s_per_row is not None else float("inf")


@dataclass
class Plan:
    recompute: list[bool]  # per layer: recompute its outputs from its input (True) or reload them (False)
    predicted_s: float  # the walk's predicted duration under this plan

    @property
    def num_recomputed(self) -> int:
        return sum(self.recompute)


def plan(
    num_layers: int,
    rows: int,
    tier: str,
    layer_bytes: int,
    input_bytes: int,
    costs: CostModel,
    walk_rows: int | None = None,
) -> Plan:
    """The per-layer choice for one record in ``tier`` of ``rows`` prompt rows: ``layer_bytes`` is what the walk
    reads of a reloaded layer, ``input_bytes`` of a recomputed one (its input rows). ``walk_rows``: the rows the
    walk differentiates per layer (the prompt rows and the live rows; default ``rows``)."""
    walk_rows = rows if walk_rows is None else walk_rows
    walk = walk_rows * costs.walk_s_per_row if costs.walk_s_per_row is not None else 0.0
    reload_s, input_s = costs.read_s(tier, layer_bytes), costs.read_s(tier, input_bytes)
    recompute_s = costs.recompute_s(rows)
    recompute = [False] * num_layers
    reader = walker = 0.0  # when the reader is free, when the walk reaches the next layer
    for layer in reversed(range(num_layers)):
        reloaded = max(walker, reader + reload_s)  # when the walk could start the layer, reloaded
        recomputed = max(walker, reader + input_s) + recompute_s  # ... recomputed by the walk from its input
        if reloaded <= recomputed:
            reader += reload_s
            walker = reloaded + walk
        else:
            recompute[layer] = True
            reader += input_s
            walker = recomputed + walk
    return Plan(recompute, walker)


class _CaptureOps:
    """Computes like ``COMPUTE`` and keeps every output the record holds, under the record's names."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def layer_input(self, layer: int, h: torch.Tensor) -> None:
        pass

    def linear(self, layer, name, x, weight, bias):  # noqa: ANN001, ANN201 (the seam's signature)
        y = COMPUTE.linear(layer, name, x, weight, bias)
        self.values[name] = y
        return y

    def attention(self, layer, q, k, v, meta):  # noqa: ANN001, ANN201
        result = attend(layer, q, k, v, meta)
        self.values["attn"] = result.out.flatten(-2)
        self.values["lse"] = result.lse
        return result.out


@torch.no_grad()
def recompute_layer(
    model: Llama, adapter: LoraAdapter, layer: int, h: torch.Tensor, rot: Rotation
) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s record for the prompt rows whose inputs are ``h`` (n, d), at positions 0..n-1 (``rot``),
    computed as the serving prefill computes it (same seam, same ops) with the live adapter: what the walk would
    have read: every ``RECORDED`` tensor (the down projection, which the walk never reads, is not computed)."""
    ops = _CaptureOps()
    meta = AttentionMetadata.single(h.shape[0], need_lse=True)
    adapter = Scoped(adapter, h.shape[0]) if adapter.cut else adapter  # prompt rows: never the cut ranks
    q, k, v = model.attention_inputs(layer, h, rot, ops, adapter)
    h_mid = model.attention_output(layer, h, ops.attention(layer, q, k, v, meta), ops, adapter)
    x = rms_norm(h_mid, model.layers[layer].post_norm, model.config.rms_norm_eps)
    model.project(layer, "gate_up", x, ops, adapter)
    return {"h": h, **ops.values}


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
