"""Preference objectives with TRL's mathematics: KTO for ratings without a correction, DPO for preference pairs.

Both compare the policy (the adapted model) with a reference policy through sequence log-probabilities, the sum
over a response's tokens of log p(token | prompt, tokens before): ``r = log pi(y|x) - log pi_ref(y|x)``.

- **KTO** (TRL's ``KTOTrainer``, loss_type "kto"; Ethayarajh et al. 2024, eq. 7): a desirable response (thumbs-up)
  loses ``w_d (1 - sigmoid(beta (r - z0)))``, an undesirable one (thumbs-down) ``w_u (1 - sigmoid(beta (z0 - r)))``;
  the loss is their mean over the KTO samples of the batch. ``z0``, the reference point, estimates
  KL(pi || pi_ref) from mismatched prompt-completion pairs of the same batch, the completions rotated by one
  (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}): ``z0 = max(0, mean(log pi(y'|x) - log pi_ref(y'|x)))``, detached.
- **DPO** (TRL's ``DPOTrainer``, loss_type "sigmoid"; Rafailov et al. 2023): a pair (chosen y_w, rejected y_l)
  loses ``-log sigmoid(beta ((r_w) - (r_l)))``; the loss is the mean over the pairs.

The reference policy is the base model (the adapter off), as TRL's trainers take it for a new PEFT adapter: it
never changes, so a response's reference log-probability is computed once (``Reference``), whatever adapter
version served it and however many steps later it is trained, and it is the model the anchors keep the adapter
close to (``alchemist.training.anchors``). beta = 0.1 for both, weights 1, as TRL's defaults.

In a training step, the objectives enter as ``PreferenceTerm``s of samples: the sample's value is its sequence
log-probability (``alchemist.training.losses.sequence_logp``), and ``preference_loss`` turns a group's values into
their share of the step's loss. A DPO pair's two samples are always trained in the same group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceTerm:
    """What a sample adds to the step's loss, as a function of its policy sequence log-probability."""

    kind: Literal["kto", "dpo"]
    ref_logp: float  # log pi_ref(response | prompt), summed over the response
    weight: float  # its share of the step's loss: the kind's weight / count (KTO: times w_d or w_u)
    beta: float = 0.1
    desirable: bool = True  # KTO: a desirable (True) or undesirable response; DPO: the chosen (True) or rejected
    kl: float = 0.0  # KTO: the batch's reference point z0
    pair: int | None = None  # DPO: the pair's id in the batch (its chosen and rejected sample share it)


def kto_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Each sample's weighted KTO loss (the batch loss is their mean); ``desirable`` is a bool tensor."""
    r = logps - ref_logps
    chosen = 1 - torch.sigmoid(beta * (r - kl))
    rejected = 1 - torch.sigmoid(beta * (kl - r))
    return torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """The reference point z0 from the mismatched pairs' log-probabilities: detached, clamped at 0."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def mismatched(indices: Sequence[int]) -> list[int]:
    """The completion paired with each prompt for z0, TRL's rotation by one: prompt i gets completion i - 1."""
    return [indices[i - 1] for i in range(len(indices))]


def dpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """Each pair's DPO sigmoid loss (the batch loss is their mean)."""
    delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * delta)


def preference_loss(values: torch.Tensor, terms: Sequence[PreferenceTerm]) -> tuple[torch.Tensor, list[float]]:
    """The share of a step's loss of samples with ``terms`` (their sequence log-probabilities ``values``; the
    gradient flows into them), and each sample's own unweighted loss (a DPO pair's on both of its samples)."""
    losses: list[float] = [0.0] * len(terms)
    total = values.new_zeros(())
    for i, term in enumerate(terms):
        if term.kind == "kto":
            ref, desirable = values.new_tensor(term.ref_logp), torch.tensor(term.desirable)
            loss = kto_losses(values[i], ref, desirable, term.kl, term.beta)
            total = total + term.weight * loss
            losses[i] = loss.item()
    pairs: dict[int, dict[bool, int]] = {}
    for i, term in enumerate(terms):
        if term.kind == "dpo":
            assert term.pair is not None
            pairs.setdefault(term.pair, {})[term.desirable] = i
    for pair, sides in pairs.items():
        if set(sides) != {True, False}:
            raise ValueError(f"DPO pair {pair} is incomplete in this group: a pair is trained together")
        c, r = sides[True], sides[False]
        ref_c, ref_r = (values.new_tensor(terms[i].ref_logp) for i in (c, r))
        loss = dpo_losses(values[c], values[r], ref_c, ref_r, terms[c].beta)
        total = total + terms[c].weight * loss
        losses[c] = losses[r] = loss.item()
    return total, losses
