"""The recompute path: what a separate trainer does, one forward over prompt + response and one backward.

It is the reference the replay path is tested against, and the fallback when a sample has no usable record.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alchemist.model.attention import AttentionMetadata
from alchemist.model.llama import Adapter, Llama
from alchemist.training.anchors import Targets, kl_to_targets


def response_loss(
    model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor, targets: Targets | None = None
) -> torch.Tensor:
    """The loss of the R hidden rows that predict the response (positions P-1..P+R-2): mean cross-entropy of the
    response tokens, or with ``targets`` (an anchor) the KL from the reference distribution."""
    logits = model.logits(hidden)
    if targets is not None:
        return kl_to_targets(logits, targets)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the loss in fp32
    return F.cross_entropy(logits, response_ids)


def recompute_loss(
    model: Llama,
    adapter: Adapter | None,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    targets: Targets | None = None,
) -> torch.Tensor:
    """Loss of one sample, computing the whole forward (the last response token is never an input)."""
    ids = torch.cat([prompt_ids, response_ids[:-1]])
    num_prompt = len(prompt_ids)
    hidden = model(ids, torch.arange(len(ids), device=ids.device), AttentionMetadata.single(len(ids)), adapter=adapter)
    return response_loss(model, hidden[num_prompt - 1 :], response_ids, targets)
