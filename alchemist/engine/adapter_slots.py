"""The served adapters stacked for grouped deltas: one slot each, per layer and fused projection one (S, ...) stack.

    slots = AdapterSlots(model_config, dtype, device)
    index = slots.assign(adapters, live)         # their slots (copied in on first use); frees those no longer live
    a, bs = slots.weights(layer, "qkv", lo, hi)  # A (G, in, P*R), per part B (G, R, part out): views, no copy

A step whose rows have many adapters computes their deltas together (``alchemist.engine.adapter_groups``): one
batched matmul over the adapters instead of one pair of matmuls per adapter, which needs each adapter's ``scaling *
A^T`` and ``B^T`` (``ServedAdapter.fused``) side by side in one tensor. Copying them together every step would cost
more than the deltas (about 30 MB per rank-16 adapter of SmolLM2 in fp32), so they are copied once, into a slot, when
an adapter first serves such a step, and stay there while the runner serves it. Slots are taken lowest first, so the
adapters of a step are usually one contiguous range of slots and the matmuls read the stacks as views.

A fused projection of P parts (qkv: 3) keeps A as P column blocks of R ranks (R: the highest rank held) and a B per
part, not ``ServedAdapter``'s one block-diagonal B: its zero blocks are two thirds of qkv's B and half of gate_up's,
and a grouped delta of decode rows costs about what reading its weights costs. Past an adapter's own rank, and where
it does not target a part, its columns of A and rows of B are zero: they add exact zeros. The stacks hold fp32 (fp64
for an fp64 model), the dtype of every delta of fewer than ``FP32_MAX_ROWS`` rows (``ServedAdapter``), the only rows
grouped.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from alchemist.engine.served_adapter import ServedAdapter
from alchemist.model.config import ModelConfig
from alchemist.model.lora import FUSED_PARTS, part_shapes


class AdapterSlots:
    def __init__(self, config: ModelConfig, model_dtype: torch.dtype, device: torch.device | str) -> None:
        self.config = config
        self.dtype = torch.promote_types(model_dtype, torch.float32)  # as ServedAdapter's fp32 weights
        self.device = torch.device(device)
        self.held: list[ServedAdapter | None] = []  # per slot: its adapter (None: free)
        self.capacity = 0  # slots the stacks have room for (at least len(held))
        self._slot: dict[ServedAdapter, int] = {}
        self.names: list[frozenset[str]] = []  # per slot: the fused projections its adapter targets
        self.rank = 0  # R: the highest rank of the adapters held (0: the stacks are not made yet)
        # per fused projection, per layer: A (S, in, P*R) and per part B (S, R, part out); the cut columns (S, P*R)
        self._stacks: dict[str, list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]] = {}
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
            free += range(len(self.held), needed)
            self.held += [None] * (needed - len(self.held))
            self.names += [frozenset()] * (needed - len(self.names))
        rank = max((a.r for a in new), default=0)
        if len(self.held) > self.capacity or rank > self.rank:  # new stacks, every held adapter copied in again
            self.capacity = max(len(self.held), 2 * self.capacity)  # twice at least: growing copies them all
            self.rank = max(rank, self.rank)
            self._make_stacks()
        for adapter, slot in zip(new, free[: len(new)], strict=True):  # lowest slots first
            self._copy_in(adapter, slot)
        return [self._slot[adapter] for adapter in adapters]

    def weights(
        self, layer: int, name: str, lo: int, hi: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The stacks of slots lo .. hi - 1 for the fused projection: A (G, in, P*R) and per part B (G, R, part
        out); None if the stacks are not made."""
        stacks = self._stacks.get(name)
        if stacks is None:
            return None
        a, bs = stacks[layer]
        return a[lo:hi], tuple(b[lo:hi] for b in bs)

    def cut_columns(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """(G, P*R) bool: per slot of lo .. hi - 1, the projection's columns that are its adapter's cut ranks (the
        same in every layer: the first ``cut`` ranks of each part)."""
        return self._cut[name][lo:hi]

    def _make_stacks(self) -> None:
        """Zero stacks of ``capacity`` slots and width ``rank``, and the adapters held copied in."""
        shapes, s, r = part_shapes(self.config), self.capacity, self.rank
        kw = {"dtype": self.dtype, "device": self.device}
        for name, parts in FUSED_PARTS.items():
            in_features = shapes[parts[0]][0]
            self._stacks[name] = [
                (torch.zeros(s, in_features, len(parts) * r, **kw),
                 tuple(torch.zeros(s, r, shapes[part][1], **kw) for part in parts))
                for _ in range(self.config.num_layers)
            ]  # fmt: skip
            self._cut[name] = torch.zeros(s, len(parts) * r, dtype=torch.bool, device=self.device)
        for slot, adapter in enumerate(self.held):
            if adapter is not None:
                self._copy_in(adapter, slot)

    def _copy_in(self, adapter: ServedAdapter, slot: int) -> None:
        shapes, big_r, r = part_shapes(self.config), self.rank, adapter.r
        for name, parts in FUSED_PARTS.items():
            targeted = adapter.targeted[name]
            cut = self._cut[name][slot]
            cut.zero_()
            for p, part in enumerate(parts):
                if part in targeted and adapter.cut:
                    cut[p * big_r : p * big_r + adapter.cut] = True
            for layer, (a, bs) in enumerate(self._stacks[name]):
                a[slot].zero_()
                weights = adapter.fused(layer, name)  # (in, len(targeted)*r), block-diagonal (len(targeted)*r, out)
                col = 0
                for p, (part, b) in enumerate(zip(parts, bs, strict=True)):
                    b[slot].zero_()
                    width = shapes[part][1]
                    if weights is not None and part in targeted:
                        at, bt = weights
                        j = targeted.index(part)
                        a[slot, :, p * big_r : p * big_r + r] = at[:, j * r : (j + 1) * r]
                        b[slot, :r] = bt[j * r : (j + 1) * r, col : col + width]
                    col += width
        self.held[slot] = adapter
        self.names[slot] = frozenset(name for name, targeted in adapter.targeted.items() if targeted)
        self._slot[adapter] = slot
