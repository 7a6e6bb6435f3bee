"""Several served adapters in one forward: each row gets the delta of its own adapter, or none (the base model).

    rows = AdapterRows.of(adapters, num_tokens, answer, device)   # per sequence of the batch: its ServedAdapter
    hidden = model(input_ids, positions, meta, ops, rows)         # ops: the base projections, for every row

A step whose rows are served by different adapters cannot use one merged weight (``MergedLinearOps``), so the base
projection is computed once for all rows and each adapter adds its low-rank delta to its own rows only: the idea of
Punica's SGMV (segmented gather matrix-vector) and of vLLM's CPU Punica wrapper. A batch's rows are contiguous per
sequence, so an adapter's rows are a few segments; they are gathered (``index_select``; a plain slice when they are
one run) into one input, so each adapter costs the same two small matmuls per projection as when it serves alone
(``ServedAdapter.delta``), whatever the number of its sequences, and its delta is scattered back into a zero delta
for the batch. Rows of the base model get nothing.

This is an adapter as ``Llama.project`` reads one (``alchemist.model.llama.Adapter``), like ``RowScope``: the model
stays the same math. It is the simple twin of the grouped deltas (``alchemist.engine.adapter_groups``), which use it
for the adapters they leave alone (a prompt chunk's), and the tests' reference for them.
"""

from __future__ import annotations

import torch

from alchemist.engine.served_adapter import ServedAdapter


class AdapterRows:
    """Per adapter: its rows of the batch (a slice, or indices) and, where it has cut ranks, the (rows,) mask of
    those out of their scope (``ServedAdapter.delta``'s ``unscoped``)."""

    def __init__(self, groups: list[tuple[ServedAdapter, slice | torch.Tensor, torch.Tensor | None]]) -> None:
        self.groups = groups

    @classmethod
    def of(
        cls,
        adapters: list[ServedAdapter | None],
        num_tokens: list[int],
        answer: list[int],
        device: torch.device,
    ) -> AdapterRows:
        """The rows of a batch whose i-th sequence computes ``num_tokens[i]`` rows with ``adapters[i]`` (None: the
        base model); ``answer``: the batch's rows in scope of the cut ranks (``ModelRunner.answer_rows``)."""
        rows_of: dict[ServedAdapter, list[int]] = {}  # insertion-ordered: adapters in order of their first row
        row = 0
        for adapter, num in zip(adapters, num_tokens, strict=True):
            if adapter is not None:
                rows_of.setdefault(adapter, []).extend(range(row, row + num))
            row += num
        in_scope = set(answer)
        groups = []
        for adapter, rows in rows_of.items():
            unscoped = None
            if adapter.cut:
                unscoped = torch.tensor([r not in in_scope for r in rows], dtype=torch.bool, device=device)  # (R,)
            groups.append((adapter, _as_index(rows, device), unscoped))
        return cls(groups)

    def delta(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The batch's delta on x (T, in) -> (T, out): each adapter's on its rows, zeros on the base model's; None
        if no adapter of the batch targets the projection. ``out``: a delta to write this one's rows into (the
        grouped adapters', ``alchemist.engine.adapter_groups``), returned."""
        for adapter, rows, unscoped in self.groups:
            # A bf16 model's delta dtype follows the rows given (FP32_MAX_ROWS): an adapter's rows here, all of its
            # sequences together, so a row's delta may be rounded otherwise than when it is served alone.
            part = adapter.delta(layer, name, x[rows], unscoped)  # (R, out)
            if part is None:
                continue
            if out is None:
                out = x.new_zeros(x.shape[0], part.shape[1])  # (T, out)
            out[rows] = part
        return out


def _as_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Ascending rows as a slice where they are one run (a view, no gather), else as indices (R,)."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)
