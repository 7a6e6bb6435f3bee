"""Preference ranks: the adapter's ranks split between what corrections teach and what preferences teach.

A correction is learned through the protected directions' complement and kept close to the base model on served
traffic by the anchors (``alchemist.training.protected``, ``alchemist.training.anchors``): both are there to keep
ordinary chat as it was. A preference people show with thumbs or pairs (shorter answers, say) is a change to
ordinary chat itself, so through the same ranks it was not learned (docs/benchmarks.md, "Thumbs and pairs").

So each adapter module has ``shared + preference`` ranks (``AdapterConfig.lora_r`` and ``preference_r``). The
gradients of samples without a preference term (corrections, rehearsals, anchors) go to the first ``shared`` ranks,
which alone lose the protected directions after an update; those of KTO and DPO samples go to the last
``preference`` ranks, which are free of both. What keeps those close to the base model is the objectives' own
KL term (beta; the reference is the base model) and the evaluation gate's bounds.

The forward uses every rank: replay and recompute are untouched, and a step's gradients are the plain ones with
each rank block keeping only its kind's share. The trainer never mixes the two kinds in one group of samples, and
``hold`` / ``route`` around a group put the other kind's block back as it was before the group. The step's
gradient clipping and AdamW act on the whole adapter as before: in a mixed step the clip's norm counts both kinds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from alchemist.model.lora import LoraAdapter, Rows


class RankSplit:
    """Which ranks of ``adapter`` (``r`` per module) preferences train: the last ``preference_r``."""

    def __init__(self, adapter: LoraAdapter, preference_r: int, cut: bool = False) -> None:
        r = adapter.config.r
        if not 0 < preference_r < r:
            raise ValueError(f"preference ranks must be in (0, {r}) of the adapter's {r} (got {preference_r})")
        self.adapter = adapter
        self.r = r
        self.shared_r = r - preference_r
        # ``cut``: the corrections' ranks act only from each sequence's last prompt token on, and never where a
        # preference is trained (``LoraAdapter.cut``): every prompt row is then the same whichever requests get
        # them, so a router can keep them from unrelated requests and every record still replays
        # (docs/profiles/live_rows_correction.py).
        adapter.cut = self.shared_r if cut else 0

    def _ranks(self, preference: bool) -> slice:
        return slice(self.shared_r, self.r) if preference else slice(0, self.shared_r)

    def a_rows(self, a: torch.Tensor, preference: bool) -> torch.Tensor:
        """A view of an ``A`` (parts * r, in), or of its gradient, on one kind's rows of every part: (parts, k, in)."""
        return a.view(-1, self.r, a.shape[-1])[:, self._ranks(preference)]

    def _blocks(self, preference: bool) -> Iterator[tuple[torch.nn.Parameter, slice | None]]:
        for a in self.adapter.A.values():
            yield a, None
        for b in self.adapter.B.values():
            yield b, self._ranks(preference)

    def _view(self, grad: torch.Tensor, cols: slice | None, preference: bool) -> torch.Tensor:
        return self.a_rows(grad, preference) if cols is None else grad[:, cols]

    def hold(self, preference: bool) -> list[torch.Tensor | None]:
        """Before a group of samples of one kind (``preference``: KTO or DPO): the other kind's gradient blocks."""
        return [None if p.grad is None else self._view(p.grad, cols, not preference).clone()
                for p, cols in self._blocks(not preference)]  # fmt: skip

    def route(self, preference: bool, held: list[torch.Tensor | None]) -> None:
        """After that group: the other kind's blocks get back what ``hold`` kept (zeros where there was none)."""
        for (p, cols), kept in zip(self._blocks(not preference), held, strict=True):
            if p.grad is None:
                continue
            view = self._view(p.grad, cols, not preference)
            if kept is None:
                view.zero_()
            else:
                view.copy_(kept)


def widen(old: LoraAdapter, initial: LoraAdapter, optimizer_state: dict) -> dict:
    """An adapter saved before its preference ranks (``old``: the shared ranks alone, at the same scaling), made the
    shape of ``initial``: ``old``'s ranks first, then ``initial``'s preference ranks as a fresh adapter has them (A
    as initialized, B zero), so it serves exactly what ``old`` served. Loads the result into ``initial`` and returns
    the optimizer state widened alike (Adam's moments zero on the new ranks). A data dir written before
    ``AdapterConfig.preference_r`` existed restarts this way."""
    r, old_r = initial.config.r, old.config.r
    if not 0 < old_r < r or old.config.scaling != initial.config.scaling:
        raise ValueError(f"an adapter of r={old_r}, scaling {old.config.scaling} cannot become the first ranks of "
                         f"one of r={r}, scaling {initial.config.scaling}")  # fmt: skip

    def wide(name: str, into: torch.Tensor, narrow: torch.Tensor) -> torch.Tensor:
        out = into.detach().clone()
        if name.startswith("A."):  # (parts * r, in): each part's first old_r rows
            out.view(-1, r, out.shape[-1])[:, :old_r] = narrow.view(-1, old_r, narrow.shape[-1])
        else:  # B (out, r): the first old_r columns; the preference ranks' stay zero
            out[:, old_r:] = 0
            out[:, :old_r] = narrow
        return out

    params = dict(initial.named_parameters())
    narrow = dict(old.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(wide(name, p, narrow[name]))
    names = list(params)  # the optimizer's parameter order: ``adapter.parameters()``'s
    state = {}
    for index, entry in optimizer_state.get("state", {}).items():
        name, shape = names[index], params[names[index]].shape
        state[index] = {key: wide(name, torch.zeros(shape, dtype=value.dtype, device=value.device), value)
                        if torch.is_tensor(value) and value.dim() == 2 else value
                        for key, value in entry.items()}  # fmt: skip
    return {**optimizer_state, "state": state}


class Scoped:
    """``adapter`` as ``Llama.project`` reads it (``delta``), with ``unscoped`` rows out of the cut ranks' reach."""

    def __init__(self, adapter: LoraAdapter, unscoped: Rows) -> None:
        self.adapter, self.unscoped = adapter, unscoped

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        return self.adapter.delta(layer, name, x, self.unscoped)


def answer_scope(adapter, pairs, in_scope: bool = True):
    """The adapter over (prompt, response) pairs laid end to end (``alchemist.training.recompute``): the cut ranks
    act on each pair's rows from its last prompt token on (``in_scope``), or on none; ``adapter`` itself where
    nothing is cut (or it is None)."""
    if adapter is None or not getattr(adapter, "cut", 0):
        return adapter
    if not in_scope:
        return Scoped(adapter, sum(len(p) + len(r) - 1 for p, r in pairs))
    masks = [torch.arange(len(p) + len(r) - 1, device=p.device) < len(p) - 1 for p, r in pairs]
    return Scoped(adapter, torch.cat(masks))
