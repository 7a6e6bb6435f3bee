"""Where one replay gets its record's layers: the store, through the prefetch window, reloaded or recomputed.

The live stream's forward (phase 1 of ``alchemist.training.replay``) reads each layer's input and q/k/v in forward
order, synchronously (a small part of each layer). The walk (phase 2) takes the layers from the top through a
``LayerWindow`` whose thread reads them ahead; per layer the ``hedge.plan`` for the record's tier says whether the
thread reloads the layer's outputs or only its input, which the walk then turns into the outputs by recomputing the
layer (``hedge.recompute_layer``). Every read, walk layer and recomputation is timed into the ``CostModel`` that
the next plan is made from, and counted.
"""

from __future__ import annotations

import time

import torch

from alchemist.activations.record import Record, record_widths
from alchemist.activations.store import ActivationStore
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.training.hedge import WALK_NAMES, CostModel, Plan, plan, recompute_layer
from alchemist.training.layer_window import LayerWindow


class RecordReader:
    """The layers of one pinned record for one replay of its first ``num_rows`` rows; close it when done."""

    def __init__(
        self,
        store: ActivationStore,
        record: Record,
        model: Llama,
        adapter: LoraAdapter,
        num_rows: int,
        costs: CostModel,
        stats,  # counts layers_reloaded, layers_recomputed, record_bytes_read (the trainer's stats)
        depth: int,
    ) -> None:
        self.store, self.record_id = store, record.record_id
        self.model, self.adapter = model, adapter
        self.num_rows, self.costs, self.stats = num_rows, costs, stats
        self.tier = store.tier_of(record.record_id) or "device"
        widths, itemsize = record_widths(model.config), record.dtype.itemsize
        row_bytes = {name: widths[name] * (4 if name == "lse" else itemsize) for name in widths}
        layer_bytes = num_rows * sum(row_bytes[name] for name in WALK_NAMES)
        input_bytes = num_rows * row_bytes["h"]
        num_layers = model.config.num_layers
        self.plan: Plan = plan(num_layers, num_rows, self.tier, layer_bytes, input_bytes, costs)
        self._rot = model.rope(torch.arange(num_rows, device=model.device), model.dtype)
        self._window = LayerWindow(self._read, reversed(range(num_layers)), depth if num_rows else 0)
        self._walk_start: float | None = None  # when the walk got its previous layer
        self._paused = 0.0  # of the time since, spent paused (not walking)

    def forward_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """For phase 1 (forward order): the layer's record as the store gives it."""
        return self.store.get_layer(self.record_id, layer)

    def walk_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """For the walk (layers from the top, each once): the layer's outputs, reloaded or recomputed."""
        now = time.perf_counter()
        if self._walk_start is not None:  # the walk just finished the layer above
            self.costs.observe_walk(self.num_rows, now - self._walk_start - self._paused)
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
        self._window.close()

    def _read(self, layer: int) -> dict[str, torch.Tensor]:
        """On the window's thread: what the walk needs of the layer (timed into the tier's read bandwidth)."""
        start = time.perf_counter()
        values = self.store.get_layer(self.record_id, layer)
        if self.plan.recompute[layer]:
            values = {"h": values["h"]}
        else:
            values = {name: values[name] for name in WALK_NAMES}
        num_bytes = sum(t.numel() * t.element_size() for t in values.values())
        self.costs.observe_read(self.tier, num_bytes, time.perf_counter() - start)
        self.stats.record_bytes_read += num_bytes
        return values
