"""Where one replay gets its record's layers: the store, through the prefetch window, reloaded or recomputed.

The live forward (phase 1 of ``alchemist.training.replay``) reads each layer's input and q/k/v
(``FORWARD_NAMES``, a quarter of a layer's bytes) in forward order, the walk (phase 2) what it needs of each layer
from the top; each through a ``LayerWindow`` whose thread reads ahead. Per layer the ``hedge.plan`` for the
record's tier says whether the walk's thread reloads the layer's outputs or only its input, which the walk then
turns into the outputs by recomputing the layer (``hedge.recompute_layer``). Every read, walk layer and
recomputation is timed into the ``CostModel`` that the next plan is made from, and counted.
"""

from __future__ import annotations

import time

import torch

from alchemist.activations.record import RECORDED, Record, record_widths
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.training.hedge import CostModel, Plan, plan, recompute_layer
from alchemist.training.layer_window import LayerWindow
from alchemist.training.seams import RecordSource

FORWARD_NAMES = ("h", "qkv")  # what phase 1 reads: the prompt's keys and values are rebuilt from them


class RecordReader:
    """The layers of one pinned record for one replay of its first ``num_rows`` rows, with ``num_live`` live rows
    (the walk differentiates both); close it when done."""

    def __init__(
        self,
        store: RecordSource,
        record: Record,
        model: Llama,
        adapter: LoraAdapter,
        num_rows: int,
        costs: CostModel,
        stats,  # counts layers_reloaded, layers_recomputed, record_bytes_read (the trainer's stats)
        depth: int,
        num_live: int = 0,
        walk_rows: int | None = None,
        walk: bool = True,  # False: the live forward only (a pass without gradient), nothing read for a walk
    ) -> None:
        self.store, self.record_id = store, record.record_id
        # the rows each step of the walk differentiates: this replay's, or those of all the samples walking with it
        self.walk_rows = num_rows + num_live if walk_rows is None else walk_rows
        self.model, self.adapter = model, adapter
        self.num_rows, self.costs, self.stats = num_rows, costs, stats
        self.tier = store.tier_of(record.record_id) or "device"
        widths, itemsize = record_widths(model.config), record.dtype.itemsize
        row_bytes = {name: widths[name] * (4 if name == "lse" else itemsize) for name in widths}
        layer_bytes = num_rows * sum(row_bytes[name] for name in RECORDED)
        input_bytes = num_rows * row_bytes["h"]
        num_layers = model.config.num_layers
        self.plan: Plan = plan(num_layers, num_rows, self.tier, layer_bytes, input_bytes, costs, self.walk_rows)
        self._rot = model.rope(torch.arange(num_rows, device=model.device), model.dtype)
        depth = depth if num_rows else 0  # a one-token prompt replays no prompt row: nothing to read
        self._forward = LayerWindow(self._read_forward, range(num_layers), depth)
        self._window = LayerWindow(self._read, reversed(range(num_layers)) if walk else (), depth if walk else 0)
        self._walk_start: float | None = None  # when the walk got its previous layer
        self._paused = 0.0  # of the time since, spent paused (not walking)

    def forward_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """For phase 1 (forward order, each layer once): the layer's input and q/k/v rows."""
        return self._forward.take(layer)

    def walk_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """For the walk (layers from the top, each once): the layer's outputs, reloaded or recomputed."""
        now = time.perf_counter()
        if self._walk_start is not None:  # the walk just finished the layer above
            self.costs.observe_walk(self.walk_rows, now - self._walk_start - self._paused)
        values = self._window.take(layer)
        if self.plan.recompute[layer]:
            start = time.perf_counter()
            h = values["h"][: self.num_rows].to(self.model.dtype)
            values = recompute_layer(self.model, self.adapter, layer, h, self._rot)
            self.costs.observe_recompute(self.num_rows, time.perf_counter() - start)
            self.stats.layers_recomputed += 1
        else:
            self.stats.layers_reloaded += 1
        self._walk_start, self._paused = time.perf_counter(), 0.0
        return values

    def paused_for(self, seconds: float) -> None:
        """The replay was paused (serving ran) for this long: not walk time."""
        self._paused += seconds

    def close(self) -> None:
        self._forward.close()
        self._window.close()

    def _read_forward(self, layer: int) -> dict[str, torch.Tensor]:
        return self._timed_read(layer, FORWARD_NAMES)

    def _read(self, layer: int) -> dict[str, torch.Tensor]:
        """On the window's thread: what the walk needs of the layer."""
        return self._timed_read(layer, ("h",) if self.plan.recompute[layer] else RECORDED)

    def _timed_read(self, layer: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Reads ``names`` of the layer, timed into the tier's read bandwidth."""
        start = time.perf_counter()
        values = self.store.get_layer(self.record_id, layer, names)
        num_bytes = sum(t.numel() * t.element_size() for t in values.values())
        self.costs.observe_read(self.tier, num_bytes, time.perf_counter() - start)
        self.stats.record_bytes_read += num_bytes
        return values
