"""The rows of a replay walk over several samples: how they are laid out and what is kept of them.

A walk runs several samples' rows through each layer together: first the prompt rows (positions 0..P-2, their
forward values read from the records: ``PromptRecord``), sample after sample, then the live rows (P-1..P+R-2, their
forward values kept by the live forward: ``LiveLayer``) in the same order (``Packing``). One sample is exactly the
layout of a single sequence, [prompt; live]. The walk itself: ``replay.py``; one layer's backward over these rows:
``layer_backward.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class PromptRecord:
    """One layer's records of the prompts of a walk, sample i's first ``counts[i]`` rows (its prompt rows), read
    as one block of rows sample after sample; and the compute dtype they are cast to where used."""

    def __init__(
        self, layer_records: Sequence[dict[str, torch.Tensor]], counts: Sequence[int], dtype: torch.dtype
    ) -> None:
        self.sources = list(layer_records)
        self.counts = list(counts)
        self.num_rows = sum(self.counts)
        self.dtype = dtype

    def rows_into(self, name: str, out: torch.Tensor, cols: slice = slice(None)) -> torch.Tensor:
        """Copies the recorded rows (their columns ``cols``) into ``out`` (``num_rows`` rows, any dtype: cast as
        copied), sample after sample; returns ``out``. One pass over the record: concatenating the samples' rows
        first and then copying them would be two."""
        at = 0
        for source, n in zip(self.sources, self.counts, strict=True):
            out[at : at + n].copy_(source[name][:n, cols])
            at += n
        return out

    def fresh_rows(self, name: str, cols: slice = slice(None)) -> torch.Tensor:
        """The recorded rows (columns ``cols``) in a new tensor of the compute dtype."""
        first = self.sources[0][name][:0, cols]
        return self.rows_into(name, first.new_empty(self.num_rows, first.shape[-1], dtype=self.dtype), cols)

    def read_rows(self, name: str, cols: slice = slice(None)) -> torch.Tensor:
        """The recorded rows (columns ``cols``) in the compute dtype, to read, never write: of one sample in that
        dtype, the record's own memory; else ``fresh_rows``."""
        if len(self.sources) == 1 and self.sources[0][name].dtype == self.dtype:
            return self.sources[0][name][: self.num_rows, cols]
        return self.fresh_rows(name, cols)


class Packing:
    """Where each sample's rows are in a walk over several: first the prompt rows, ``prompt[i]`` of sample i,
    sample after sample, then the live rows, ``live[i]`` of each, in the same order. One sample: [prompt; live].

    Row-wise work runs on all rows at once; attention needs each sample's own rows, prompt then live, together:
    ``segment`` gathers them (a view for one sample), ``join`` puts per-sample results back in this order."""

    def __init__(self, prompt: Sequence[int], live: Sequence[int]) -> None:
        self.prompt, self.live = list(prompt), list(live)
        self.num_prompt, self.num_live = sum(self.prompt), sum(self.live)
        self._prompt_at = [sum(self.prompt[:i]) for i in range(len(self.prompt))]
        self._live_at = [sum(self.live[:i]) for i in range(len(self.live))]

    def __len__(self) -> int:
        return len(self.prompt)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """Each row's position in its own sequence."""
        prompt = [torch.arange(n, device=device) for n in self.prompt]
        live = [torch.arange(n, n + r, device=device) for n, r in zip(self.prompt, self.live, strict=True)]
        return torch.cat(prompt + live)

    def prompt_rows(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Sample i's rows of a tensor of the prompt rows only."""
        return t[self._prompt_at[i] : self._prompt_at[i] + self.prompt[i]]

    def live_rows(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Sample i's rows of a tensor of the live rows only."""
        return t[self._live_at[i] : self._live_at[i] + self.live[i]]

    def segment(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Sample i's rows, prompt then live, of a tensor of all rows (a view for one sample)."""
        if len(self) == 1:
            return t
        return torch.cat([self.prompt_rows(t[: self.num_prompt], i), self.live_rows(t[self.num_prompt :], i)])

    def join(self, segments: Sequence[torch.Tensor]) -> torch.Tensor:
        """``segment``'s inverse: per-sample rows (prompt then live, each) -> all rows in this packing's order."""
        if len(self) == 1:
            return segments[0]
        prompt = [s[:n] for s, n in zip(segments, self.prompt, strict=True)]
        live = [s[n:] for s, n in zip(segments, self.prompt, strict=True)]
        return torch.cat(prompt + live)


class LiveLayer(NamedTuple):
    """What the live forward keeps of one layer for the walk: the R live rows' forward values (of all samples, in
    ``Packing`` order), and each sample's keys and values of its n + R rows (the prompt's rebuilt from the record)."""

    h: torch.Tensor  # (R, d) the layer's input
    q: torch.Tensor  # (R, H, Dh) RoPE'd
    k: list[torch.Tensor]  # per sample (n + R, Hkv, Dh) RoPE'd
    v: list[torch.Tensor]  # per sample (n + R, Hkv, Dh)
    attn: torch.Tensor  # (R, H * Dh) attention output over all n + R keys
    lse: torch.Tensor  # (R, H) its log-sum-exp (fp32; fp64 for fp64)
    h_mid: torch.Tensor  # (R, d) after the attention's residual add
    gate_up: torch.Tensor  # (R, 2 * intermediate) with the LoRA delta
