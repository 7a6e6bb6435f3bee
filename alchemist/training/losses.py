"""The losses of a sample, on the R hidden rows that predict its response (positions P-1..P+R-2).

Both training paths (``recompute``, ``replay``) end here: the cross-entropy of the response tokens, or for an
anchor (``alchemist.training.anchors``) the KL from a reference distribution kept as its top-k ``Targets``, or for
a preference objective (``alchemist.training.objectives``) the response's sequence log-probability, which the
objective turns into loss. All are computed in (at least) fp32, also for a bf16 model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from alchemist.model.llama import Llama


@dataclass(frozen=True)
class Targets:
    """The reference distribution at each of R response positions, top-k: token ids (R, k), log-probs (R, k)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the vocabulary, in (at least) fp32."""
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def kl_to_targets(logits: torch.Tensor, targets: Targets) -> torch.Tensor:
    """Mean over positions of sum_j p_j (log p_j - log q_j), j over the targets' top-k tokens; logits (R, vocab)."""
    logq = log_probs(logits)
    logp = targets.logprobs.to(logq.dtype)
    return (logp.exp() * (logp - logq.gather(-1, targets.ids))).sum(-1).mean()


def response_loss(
    model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor, targets: Targets | None = None
) -> torch.Tensor:
    """Mean cross-entropy of the response tokens from their R hidden rows, or with ``targets`` the KL to them."""
    logits = model.logits(hidden)
    if targets is not None:
        return kl_to_targets(logits, targets)
    return F.nll_loss(log_probs(logits), response_ids)


def sequence_logp(model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
    """log p(response | prompt): the sum of the response tokens' log-probabilities, from their R hidden rows."""
    return log_probs(model.logits(hidden)).gather(-1, response_ids[:, None]).sum()
