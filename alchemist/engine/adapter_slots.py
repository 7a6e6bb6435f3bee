"""The served adapters stacked for grouped deltas: one slot each, per layer and fused projection one (S, ...) stack.

    slots = AdapterSlots(num_layers, dtype, device)
    index = slots.assign(adapters, live)      # their slots (copied in on first use); frees those no longer live
    a, b = slots.weights(layer, "qkv", lo, hi)  # (hi - lo, in, R) and (hi - lo, R, out): views, no copy

A step whose rows have many adapters computes their deltas together (``alchemist.engine.adapter_groups``): one
batched matmul over the adapters instead of one pair of matmuls per adapter, which needs each adapter's ``scaling *
A^T`` and ``B^T`` (``ServedAdapter.fused``) side by side in one tensor. Copying them together every step would cost
more than the deltas (about 30 MB per rank-16 adapter of SmolLM2 in fp32), so they are copied once, into a slot, when
an adapter first serves such a step, and stay there while the runner serves it. Slots are taken lowest first, so the
adapters of a step are usually one contiguous range of slots and the matmul reads the stacks as views.

The width R of a projection's stack is the widest ``parts * r`` of the adapters held; a narrower adapter's columns of
A and rows of B are zero past its own, as are a slot's weights where its adapter does not target the projection:
they add exact zeros. The stacks hold fp32 (fp64 for an fp64 model), the dtype of every delta of fewer than
``FP32_MAX_ROWS`` rows (``ServedAdapter``), the only rows grouped.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from alchemist.engine.served_adapter import ServedAdapter
from alchemist.model.lora import FUSED_PARTS


class AdapterSlots:
    def __init__(self, num_layers: int, model_dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_layers = num_layers
        self.dtype = torch.promote_types(model_dtype, torch.float32)  # as ServedAdapter's fp32 weights
        self.device = torch.device(device)
        self.held: list[ServedAdapter | None] = []  # per slot: its adapter (None: free)
        self.capacity = 0  # slots the stacks have room for (at least len(held))
        self._slot: dict[ServedAdapter, int] = {}
        self.names: list[frozenset[str]] = []  # per slot: the fused projections its adapter targets
        # per fused projection: per layer, (A (S, in, R), B (S, R, out)); and the cut columns (S, R) bool
        self._stacks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._cut: dict[str, torch.Tensor] = {}

    @torch.inference_mode()  # the stacks are inference tensors wherever they are made: always written in this mode
    def assign(self, adapters: Collection[ServedAdapter], live: Collection[ServedAdapter]) -> list[int]:
        """The slots of ``adapters``, copying in those that have none; first frees the slots of adapters not in
        ``live`` (those the runner no longer serves), so that their slots go to the new ones."""
        for adapter, slot in list(self._slot.items()):
            if adapter not in live:
                del self._slot[adapter]
                self.held[slot] = None
        new = [a for a in dict.fromkeys(adapters) if a not in self._slot]
        free = [slot for slot, adapter in enumerate(self.held) if adapter is None]
        if len(new) > len(free):
            needed = len(self.held) + len(new) - len(free)
            if needed > self.capacity:  # to twice the slots at least: stacks are copied whole when they grow
                self._grow(max(needed, 2 * self.capacity))
            free += range(len(self.held), needed)
            self.held += [None] * (needed - len(self.held))
            self.names += [frozenset()] * (needed - len(self.names))
        for adapter, slot in zip(new, free[: len(new)], strict=True):  # lowest slots first
            self._copy_in(adapter, slot)
        return [self._slot[adapter] for adapter in adapters]

    def weights(self, layer: int, name: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stacks of slots lo .. hi - 1 for the fused projection: A (G, in, R), B (G, R, out); None if no adapter
        held targets it."""
        stacks = self._stacks.get(name)
        if stacks is None:
            return None
        a, b = stacks[layer]
        return a[lo:hi], b[lo:hi]

    def cut_columns(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """(G, R) bool: per slot of lo .. hi - 1, the projection's columns that are its adapter's cut ranks (the same
        in every layer: the first ``cut`` ranks of each part)."""
        return self._cut[name][lo:hi]

    def _grow(self, capacity: int) -> None:
        """Room in every stack for ``capacity`` slots."""
        self.capacity = capacity
        for name in self._stacks:
            self._resize(name, capacity, self._cut[name].shape[1])

    def _copy_in(self, adapter: ServedAdapter, slot: int) -> None:
        targeted = {name for name in FUSED_PARTS if adapter.fused(0, name) is not None}
        for name in targeted:
            width = adapter.fused(0, name)[0].shape[1]  # parts * r
            if name not in self._stacks:
                self._new_stacks(name, adapter, width)
            elif width > self._cut[name].shape[1]:
                self._resize(name, self.capacity, width)
        for name, stacks in self._stacks.items():
            for layer, (a, b) in enumerate(stacks):
                a[slot].zero_()
                b[slot].zero_()
                weights = adapter.fused(layer, name)
                if weights is not None:
                    at, bt = weights
                    a[slot, :, : at.shape[1]].copy_(at)
                    b[slot, : bt.shape[0]].copy_(bt)
            cut = self._cut[name][slot]
            cut.zero_()
            cols = adapter.cut_columns(0, name)
            if cols is not None:
                cut[: cols.shape[0]] = cols
        self.held[slot] = adapter
        self.names[slot] = frozenset(targeted)
        self._slot[adapter] = slot

    def _new_stacks(self, name: str, adapter: ServedAdapter, width: int) -> None:
        """Zero stacks for a projection no adapter held targeted yet (every slot: zero weights)."""
        at, bt = adapter.fused(0, name)
        s, kw = self.capacity, {"dtype": self.dtype, "device": self.device}
        self._stacks[name] = [
            (torch.zeros(s, at.shape[0], width, **kw), torch.zeros(s, width, bt.shape[1], **kw))
            for _ in range(self.num_layers)
        ]
        self._cut[name] = torch.zeros(s, width, dtype=torch.bool, device=self.device)

    def _resize(self, name: str, num_slots: int, width: int) -> None:
        """The projection's stacks grown to ``num_slots`` slots and ``width`` columns (a copy; new entries zero)."""

        def grown(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            new = t.new_zeros(shape)
            new[tuple(slice(0, n) for n in t.shape)] = t
            return new

        self._stacks[name] = [
            (grown(a, (num_slots, a.shape[1], width)), grown(b, (num_slots, width, b.shape[2])))
            for a, b in self._stacks[name]
        ]
        self._cut[name] = grown(self._cut[name], (num_slots, width))
