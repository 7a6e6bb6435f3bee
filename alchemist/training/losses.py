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
    """Mean over positions of KL(reference || adapted) over the targets' top-k tokens and one more outcome, "any
    other token" (the rest of each distribution's mass): the KL of the two distributions coarsened to k + 1
    outcomes, so never negative and zero only where they agree on it. The top-k terms alone are not a divergence: a
    large anchor weight rewarded moving mass onto the k tokens (docs/benchmarks.md, "Learning a correction with
    the defaults"). logits (R, vocab)."""
    logq = log_probs(logits)
    logp = targets.logprobs.to(logq.dtype)
    top = (logp.exp() * (logp - logq.gather(-1, targets.ids))).sum(-1)
    # The mass outside the top-k: the reference's from its kept log-probs, the adapted model's from its other
    # tokens (the kept ones masked by the lowest finite value, so that a k as large as the vocabulary stays finite).
    p_rest = 1.0 - logp.exp().sum(-1)
    logq_rest = logq.scatter(-1, targets.ids, torch.finfo(logq.dtype).min).logsumexp(-1)
    some = p_rest > 1e-6  # below: rounding error of a top-k that holds (nearly) all the mass
    p_rest = torch.where(some, p_rest, 1.0)
    rest = torch.where(some, p_rest * (p_rest.log() - logq_rest), 0.0)
    return (top + rest).mean()


def response_loss(
    model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor, targets: Targets | None = None
) -> torch.Tensor:
    """Mean cross-entropy of the response tokens from their R hidden rows, or with ``targets`` the KL to them."""
    logits = model.logits(hidden)
    if targets is not None:
        return kl_to_targets(logits, targets)
    return F.nll_loss(log_probs(logits), response_ids)


def sequence_logp(
    model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor, going_on: int | None = None
) -> torch.Tensor:
    """log p(response | prompt): the sum of the response tokens' log-probabilities, from their R hidden rows.

    ``going_on`` (an end-of-turn token id): each token other than it is scored given that the reply goes on, its
    probability over 1 - p(end): what the reply says, set apart from where it stops."""
    logp = log_probs(model.logits(hidden))
    taken = logp.gather(-1, response_ids[:, None])[:, 0]
    if going_on is not None:
        goes_on = response_ids != going_on
        p_end = logp[:, going_on].exp().clamp(max=1.0 - 1e-6)  # a certain end would make the rest infinitely likely
        taken = taken - torch.where(goes_on, torch.log1p(-p_end), 0.0)
    return taken.sum()


def least_token_logp(model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
    """The smallest log-probability of a response token given the tokens before it, from the R hidden rows: above
    log 1/2 every token is likelier than all others together, so greedy decoding, fed the response so far, says
    each of them (the online trainer's test that a correction is learned)."""
    return log_probs(model.logits(hidden)).gather(-1, response_ids[:, None]).min()


def first_token_margin(model: Llama, hidden: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
    """How many nats the response's first token is likelier than the likeliest other token, from the R hidden rows
    (the first one used): above 0 greedy decoding says it (the evaluation gate's test that a canary's answer is
    still the one the model gives)."""
    logp = log_probs(model.logits(hidden[:1]))[0]
    first = int(response_ids[0])
    return logp[first] - torch.cat([logp[:first], logp[first + 1 :]]).max()
