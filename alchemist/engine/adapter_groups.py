"""Several served adapters in one forward, their deltas grouped: a few torch ops per projection, however many adapters.

    rows = GroupedRows.of(slots, adapters, num_tokens, answer, live, device)  # per sequence: its ServedAdapter
    hidden = model(input_ids, positions, meta, ops, rows)                      # ops: the base projections

The simple way (``AdapterRows``, kept as the reference) costs each adapter of the step its own gather, two matmuls
and scatter per projection: with 16 adapters, 16 x 4 projections x 30 layers x about five ops, ten thousand small
torch ops a decode step, whose fixed costs, not their arithmetic, made a step of 16 adapters' rows about twice as
slow as one of one adapter's (docs/benchmarks.md, "Many adapters"). Here, as in Punica's SGMV and vLLM's Punica
wrappers, the rows of the adapters are grouped: the step's layout is built once, before the forward, as two
indices, and each projection is

    x (T, in) --gather--> (G, M, in) --bmm A (G, in, R)--> xa --bmm B (G, R, out)--> (G, M, out) --gather--> (T, out)

(one bmm B per part of the fused projection, concatenated: ``AdapterSlots`` keeps no zero blocks)

over the stacked weights of ``AdapterSlots`` (G slots, from the lowest to the highest slot of the step's adapters:
views, no copy). Each slot's rows are padded to M (the most rows of one adapter) with a zero row appended to x,
so the padding, the base model's rows and the slots of the range that no row of the step uses compute exact zeros,
and the gather back sends every row not grouped to such a zero. Only decode-sized groups are grouped, those of at
most ``GROUP_MAX_ROWS`` rows, so that padding to M stays cheap and every grouped delta is in fp32 as
``ServedAdapter.delta`` computes one of fewer than ``FP32_MAX_ROWS`` rows. An adapter with more rows in the step (a
prompt chunk) computes its delta alone (``ServedAdapter.delta``, its dtype by its rows): those matmuls are large
enough to pay their fixed costs, as are the deltas of a step whose adapters are too few or too sparse in the slots.

Cut ranks (``ServedAdapter.cut``) keep their meaning: xa's cut columns are zeroed on a cut adapter's rows out of
scope, as ``ServedAdapter.delta`` does (a (G, M, R) mask per projection, built once a step). Each grouped row gets
what ``AdapterRows`` gives it up to fp32 rounding (bmm sums in its own order; tests/engine/test_adapter_groups.py).
A decode step whose every adapter is grouped and masks no cut rank (``compilable``) runs in the compiled layer
(``CompiledDecode.forward``): ``grouped_delta`` in its graph, the indices and the stacks' views as its inputs
(``LayerDeltas``), every size dynamic, so that no composition of a batch compiles again. Figures: ``python
docs/profiles/adapter_groups.py``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch
import torch.nn.functional as F

from alchemist.engine.adapter_rows import AdapterRows
from alchemist.engine.adapter_slots import AdapterSlots
from alchemist.engine.served_adapter import FP32_MAX_ROWS, ServedAdapter
from alchemist.model.lora import FUSED_PARTS

# Adapters with at most this many rows in a step are grouped (padded to the most rows among them); more go alone. A
# bmm of so few rows per slot is bound by reading the weights, so the padding costs little. 16, not 8: 32 streams
# over 4 adapters hold 6-10 rows each as requests end and start, and an adapter over the bound sends the whole step
# eager (docs/benchmarks.md, "Many adapters": 4 adapters still serve less than 16 do, not understood yet).
GROUP_MAX_ROWS = 16
assert GROUP_MAX_ROWS < FP32_MAX_ROWS  # grouped deltas are fp32 deltas
MIN_GROUP = 2  # fewer grouped adapters than this: each alone (a group of one costs more ops than its delta alone)


class LayerDeltas(NamedTuple):
    """One layer's grouped deltas as the compiled layer takes them (``alchemist.engine.compiled_decode``): the step's
    indices and, per fused projection, the stacked A and B of its slots (None where no adapter of the step targets
    it)."""

    gather: torch.Tensor
    back: torch.Tensor
    qkv: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None
    o: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None
    gate_up: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None
    down: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None


class GroupedRows:
    """A step's grouped adapters (slots lo .. hi - 1, M rows each, ``gather`` and ``back`` indices) and, alone, the
    others (``AdapterRows``)."""

    def __init__(self, slots: AdapterSlots, lo: int, hi: int, gather: torch.Tensor, back: torch.Tensor,
                 unscoped: torch.Tensor | None, names: frozenset[str], alone: AdapterRows) -> None:  # fmt: skip
        self.slots, self.lo, self.hi = slots, lo, hi
        self.gather = gather  # (G * M,) rows of x with a zero row appended (index T: padding)
        self.back = back  # (T,) each row's place in (G * M) rows; rows not grouped: a padding place (zero)
        self.unscoped = unscoped  # (G, M) bool: rows out of scope of a cut adapter's cut ranks; None if none
        self.names = names  # the fused projections some grouped adapter targets
        self.alone = alone
        self._masks: dict[str, torch.Tensor] = {}  # per projection: (G, M, P*R) the cut entries of xa to zero

    @classmethod
    def of(
        cls,
        slots: AdapterSlots,
        adapters: list[ServedAdapter | None],
        num_tokens: list[int],
        answer: list[int],
        live: Collection[ServedAdapter],
        device: torch.device,
    ) -> GroupedRows | AdapterRows:
        """The rows of a batch whose i-th sequence computes ``num_tokens[i]`` rows with ``adapters[i]`` (None: the
        base model); ``answer``: the rows in scope of cut ranks (``ModelRunner.answer_rows``); ``live``: the
        adapters the runner serves (``AdapterSlots.assign`` frees the others' slots). An ``AdapterRows`` where
        nothing is worth grouping."""
        rows_of: dict[ServedAdapter, list[int]] = {}  # insertion-ordered: adapters in order of their first row
        row = 0
        for adapter, num in zip(adapters, num_tokens, strict=True):
            if adapter is not None:
                rows_of.setdefault(adapter, []).extend(range(row, row + num))
            row += num
        num_rows = row
        grouped = [a for a, rows in rows_of.items() if len(rows) <= GROUP_MAX_ROWS]
        index = slots.assign(grouped, live) if len(grouped) >= MIN_GROUP else []
        lo, hi = (min(index), max(index) + 1) if index else (0, 0)
        if hi - lo > 2 * len(index):  # sparse in the slots: the range would read too many idle adapters' weights
            index, lo, hi = [], 0, 0
        slot_of = dict(zip(grouped, index, strict=True)) if index else {}
        alone = AdapterRows.of([a if a not in slot_of else None for a in adapters], num_tokens, answer, device)
        if not slot_of:
            return alone
        m = max(len(rows_of[a]) for a in slot_of)
        num_grouped = sum(len(rows_of[a]) for a in slot_of)
        if num_grouped < num_rows and num_grouped == (hi - lo) * m:
            m += 1  # every place is a row: one more per slot, so that rows not grouped have a zero place to take
        gather = [num_rows] * ((hi - lo) * m)  # num_rows: the zero row appended to x
        back = [-1] * num_rows
        in_scope = set(answer)
        unscoped = [False] * ((hi - lo) * m)
        for adapter, slot in slot_of.items():
            start = (slot - lo) * m
            for j, r in enumerate(rows_of[adapter]):
                gather[start + j] = r
                back[r] = start + j
                unscoped[start + j] = bool(adapter.cut) and r not in in_scope
        zero = gather.index(num_rows) if num_grouped < num_rows else 0
        back = [zero if place < 0 else place for place in back]
        names = frozenset().union(*(slots.names[slot] for slot in slot_of.values()))

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        mask = tensor(unscoped, torch.bool).view(hi - lo, m) if any(unscoped) else None
        return cls(slots, lo, hi, tensor(gather, torch.long), tensor(back, torch.long), mask, names, alone)

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The batch's delta on x (T, in) -> (T, out): each adapter's on its rows, zeros on the base model's; None
        if no adapter of the batch targets the projection."""
        grouped = self._grouped(layer, name, x) if name in self.names else None  # zeros on the rows not grouped
        return self.alone.delta(layer, name, x, out=grouped)  # the others' rows, written into it

    @property
    def compilable(self) -> bool:
        """Every adapter of the step grouped and no cut rank masked: the compiled layer computes it all
        (``layer_deltas``)."""
        return not self.alone.groups and self.unscoped is None

    def layer_deltas(self, layer: int) -> LayerDeltas:
        weights = [self.slots.weights(layer, n, self.lo, self.hi) if n in self.names else None for n in FUSED_PARTS]
        return LayerDeltas(self.gather, self.back, *weights)

    def _grouped(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        a, bs = self.slots.weights(layer, name, self.lo, self.hi)  # (G, in, P*R), per part (G, R, part out)
        mask = self._mask(name) if self.unscoped is not None else None
        return grouped_delta(x, a, bs, self.gather, self.back, mask)

    def _mask(self, name: str) -> torch.Tensor:
        """(G, M, P*R) bool: the entries of xa that are cut ranks on rows out of their scope (made once a step)."""
        mask = self._masks.get(name)
        if mask is None:
            cut = self.slots.cut_columns(name, self.lo, self.hi)  # (G, P*R)
            mask = self._masks[name] = self.unscoped[:, :, None] & cut[:, None, :]
        return mask


def grouped_delta(
    x: torch.Tensor, a: torch.Tensor, bs: tuple[torch.Tensor, ...], gather: torch.Tensor, back: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x (T, in) -> the delta (T, out) in x's dtype: x's rows (a zero row appended) gathered into (G, M, in) by
    ``gather``, times A (G, in, P*R), xa's ``mask`` (G, M, P*R) entries zeroed, each part's R columns times its B
    (G, R, part out), gathered back by ``back``. Tensors only, for the compiled layer too."""
    xs = F.pad(x, (0, 0, 0, 1)).index_select(0, gather).to(a.dtype).view(a.shape[0], -1, x.shape[1])  # (G, M, in)
    xa = torch.bmm(xs, a)  # (G, M, P*R)
    if mask is not None:
        xa = xa.masked_fill(mask, 0)
    r = bs[0].shape[1]
    parts = [torch.bmm(xa[:, :, p * r : (p + 1) * r], b) for p, b in enumerate(bs)]  # (G, M, part out) each
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # (G, M, out)
    return delta.view(-1, delta.shape[2]).index_select(0, back).to(x.dtype)  # (T, out)
