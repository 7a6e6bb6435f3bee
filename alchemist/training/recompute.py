"""The recompute path: what a separate trainer does, one forward over prompt + response and one backward.

It is the reference the replay path is tested against, and the fallback when a sample has no usable record.
"""

from __future__ import annotations

import torch

from alchemist.model.attention import AttentionMetadata
from alchemist.model.llama import Adapter, Llama
from alchemist.training.losses import Targets, response_loss


def response_hidden(
    model: Llama, adapter: Adapter | None, prompt_ids: torch.Tensor, response_ids: torch.Tensor
) -> torch.Tensor:
    """The whole forward of prompt + response (the last response token is never an input) -> the R hidden rows
    that predict the response (positions P-1..P+R-2)."""
    ids = torch.cat([prompt_ids, response_ids[:-1]])
    hidden = model(ids, torch.arange(len(ids), device=ids.device), AttentionMetadata.single(len(ids)), adapter=adapter)
    return hidden[len(prompt_ids) - 1 :]


def recompute_loss(
    model: Llama,
    adapter: Adapter | None,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    targets: Targets | None = None,
) -> torch.Tensor:
    """Loss of one sample, computing the whole forward (``alchemist.training.losses.response_loss``)."""
    return response_loss(model, response_hidden(model, adapter, prompt_ids, response_ids), response_ids, targets)
