"""The recompute path: what a separate trainer does, one forward over prompt + response and one backward.

It is the reference the replay path is tested against, and the fallback when a sample has no usable record. The
online trainer runs it as ``LayerSplitPass``: the same forward and backward with the autograd graph cut at every
layer's output, so that both go a layer per slice (serving waits for a slice: one unsliced pass over a group of
rehearsed chat corrections took seconds; docs/benchmarks.md, "Online loop").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from alchemist.model.attention import AttentionMetadata, Segment
from alchemist.model.llama import Adapter, Llama
from alchemist.training.losses import Targets, response_loss, sequence_logp
from alchemist.training.rank_split import answer_scope
from alchemist.training.slices import run_to_end


def responses_hidden_slices(
    model: Llama,
    adapter: Adapter | None,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    in_scope: bool = True,
) -> Generator[None, None, list[torch.Tensor]]:
    """The whole forward of each (prompt ids, response ids), laid end to end and each attending to its own tokens
    (the last response token is never an input) -> its R hidden rows that predict the response (positions
    P-1..P+R-2); in slices of one layer (yields after each). An adapter's cut ranks (``LoraAdapter.cut``) act on
    the rows from P-1 on where ``in_scope``, else on none (``rank_split.answer_scope``)."""
    ids, positions, meta = _laid_end_to_end(samples)
    layers = model.forward_layers(ids, positions, meta, adapter=answer_scope(adapter, samples, in_scope))
    for _ in range(model.config.num_layers):
        hidden = next(layers)
        yield
    return _response_rows(hidden, samples)


def _laid_end_to_end(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The forward's input: each sample's prompt and response but its last token, one after the other."""
    seqs = [torch.cat([prompt, response[:-1]]) for prompt, response in samples]
    meta = AttentionMetadata([Segment(slot=i, start=0, length=len(seq)) for i, seq in enumerate(seqs)])
    positions = torch.cat([torch.arange(len(seq), device=seq.device) for seq in seqs])
    return torch.cat(seqs), positions, meta


def _response_rows(hidden: torch.Tensor, samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each sample's rows P-1..P+R-2 of the forward's output."""
    rows, start = [], 0
    for prompt, response in samples:
        rows.append(hidden[start + len(prompt) - 1 : start + len(prompt) + len(response) - 1])
        start += len(prompt) + len(response) - 1
    return rows


def recompute_losses(
    model: Llama,
    adapter: Adapter | None,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor, Targets | None]],
    logp: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """The losses of several samples (prompt ids, response ids, targets: ``alchemist.training.losses``), from one
    forward over all of them (``responses_hidden_slices``, run to its end: one slice); where ``logp[i]``, sample i's
    sequence log-probability instead (the value a preference objective takes)."""
    pairs = [(prompt, response) for prompt, response, _ in samples]
    hidden = run_to_end(responses_hidden_slices(model, adapter, pairs))
    return sample_values(model, hidden, samples, logp)


def sample_values(
    model: Llama,
    hidden: Sequence[torch.Tensor],
    samples: Sequence[tuple[torch.Tensor, torch.Tensor, Targets | None]],
    logp: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Each sample's loss, or where ``logp[i]`` its sequence log-probability, from its response rows ``hidden``."""
    logp = logp or [False] * len(samples)
    return [sequence_logp(model, rows, response) if wants_logp else response_loss(model, rows, response, targets)
            for rows, (_, response, targets), wants_logp in zip(hidden, samples, logp, strict=True)]  # fmt: skip


class LayerSplitPass:
    """``recompute_losses``' forward and backward over (prompt ids, response ids) pairs, a layer per slice: each
    layer's input is a leaf of its own graph, so the backward walks the layers from the top, handing each the
    gradient of its output (the same products as one backward of the whole graph; the same memory: every layer's
    graph lives until its backward)."""

    def __init__(
        self,
        model: Llama,
        adapter: Adapter | None,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        in_scope: bool = True,
    ):
        self.model, self.adapter, self.pairs = model, answer_scope(adapter, pairs, in_scope), pairs
        self._layers: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (input leaf, output) per layer
        self._top: torch.Tensor | None = None

    def forward_slices(self) -> Generator[None, None, list[torch.Tensor]]:
        """The forward, a layer per slice -> each pair's R response rows (the loss's input; they require grad)."""
        inputs: list[torch.Tensor | None] = [None]  # the first layer's input (the embeddings) needs no gradient

        def cut(h: torch.Tensor) -> torch.Tensor:
            inputs.append(h.detach().requires_grad_())
            return inputs[-1]

        ids, positions, meta = _laid_end_to_end(self.pairs)
        for h in self.model.forward_layers(ids, positions, meta, adapter=self.adapter, between=cut):
            self._layers.append((inputs[len(self._layers)], h))
            yield
        self._top = h.detach().requires_grad_()
        return _response_rows(self._top, self.pairs)

    def backward_slices(self, total: torch.Tensor) -> Generator[None, None, None]:
        """Backward of ``total`` (a function of the response rows): the head's part, then a layer per slice; the
        adapter's gradients accumulate as one backward's would."""
        assert self._top is not None, "forward_slices first"
        total.backward()
        grad = self._top.grad
        while self._layers:
            x, out = self._layers.pop()
            torch.autograd.backward(out, grad)
            grad = None if x is None else x.grad
            yield


def sequence_logps_slices(
    model: Llama,
    adapter: Adapter | None,
    pairs: Sequence[tuple[list[int], list[int]]],
    group_size: int = 4,
    going_on: int | None = None,
    in_scope: bool = True,
) -> Generator[None, None, list[float]]:
    """log p(response | prompt) of each (prompt ids, response ids) under ``adapter`` (None: the base model), no
    gradient: ``group_size`` pairs per forward, in slices of one layer. ``going_on``: as ``sequence_logp``'s."""
    return response_values_slices(model, adapter, pairs, lambda rows, response: sequence_logp(
        model, rows, response, going_on), group_size, in_scope)  # fmt: skip


@torch.no_grad()
def response_values_slices(
    model: Llama,
    adapter: Adapter | None,
    pairs: Sequence[tuple[list[int], list[int]]],
    value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group_size: int = 4,
    in_scope: bool = True,
) -> Generator[None, None, list[Any]]:
    """``value(hidden rows, response ids)`` of each (prompt ids, response ids) under ``adapter`` (None: the base
    model), no gradient: ``group_size`` pairs per forward, in slices of one layer. A value of one element comes back
    as a float, of several as a list of them."""
    values: list[Any] = []
    for start in range(0, len(pairs), group_size):
        group = [(torch.tensor(p, device=model.device), torch.tensor(r, device=model.device))
                 for p, r in pairs[start : start + group_size]]  # fmt: skip
        hidden = yield from responses_hidden_slices(model, adapter, group, in_scope)
        for rows, (_, response) in zip(hidden, group, strict=True):
            values.append(value(rows, response).tolist())
    return values


def recompute_loss(
    model: Llama,
    adapter: Adapter | None,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    targets: Targets | None = None,
) -> torch.Tensor:
    """Loss of one sample, computing the whole forward."""
    return recompute_losses(model, adapter, [(prompt_ids, response_ids, targets)])[0]
