"""The recompute path: what a separate trainer does, one forward over prompt + response and one backward.

It is the reference the replay path is tested against, and the fallback when a sample has no usable record.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alchemist.model.attention import AttentionMetadata, Segment
from alchemist.model.llama import Adapter, Llama
from alchemist.training.losses import Targets, response_loss


def response_hidden(
    model: Llama, adapter: Adapter | None, prompt_ids: torch.Tensor, response_ids: torch.Tensor
) -> torch.Tensor:
    """The whole forward of prompt + response (the last response token is never an input) -> the R hidden rows
    that predict the response (positions P-1..P+R-2)."""
    return responses_hidden(model, adapter, [(prompt_ids, response_ids)])[0]


def responses_hidden(
    model: Llama, adapter: Adapter | None, samples: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """``response_hidden`` of several (prompt ids, response ids), from one forward over all of them laid end to
    end, each attending to its own tokens."""
    seqs = [torch.cat([prompt, response[:-1]]) for prompt, response in samples]
    meta = AttentionMetadata([Segment(slot=i, start=0, length=len(seq)) for i, seq in enumerate(seqs)])
    positions = torch.cat([torch.arange(len(seq), device=seq.device) for seq in seqs])
    hidden = model(torch.cat(seqs), positions, meta, adapter=adapter)
    rows, start = [], 0
    for (prompt, _), seq in zip(samples, seqs, strict=True):
        rows.append(hidden[start + len(prompt) - 1 : start + len(seq)])
        start += len(seq)
    return rows


def recompute_losses(
    model: Llama,
    adapter: Adapter | None,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor, Targets | None]],
) -> list[torch.Tensor]:
    """The losses of several samples (prompt ids, response ids, targets: ``alchemist.training.losses``), from one
    forward over all of them (``responses_hidden``)."""
    hidden = responses_hidden(model, adapter, [(prompt, response) for prompt, response, _ in samples])
    return [response_loss(model, rows, response, targets)
            for rows, (_, response, targets) in zip(hidden, samples, strict=True)]  # fmt: skip


def recompute_loss(
    model: Llama,
    adapter: Adapter | None,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    targets: Targets | None = None,
) -> torch.Tensor:
    """Loss of one sample, computing the whole forward."""
    return recompute_losses(model, adapter, [(prompt_ids, response_ids, targets)])[0]
