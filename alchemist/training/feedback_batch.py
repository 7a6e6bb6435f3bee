"""A mini-batch of feedback as the samples of one optimizer step: corrections by SFT, ratings by KTO, preference
pairs by DPO, in one loss.

    batch = FeedbackBatch(items, ObjectivesConfig())
    yield from batch.references_slices(trainer)                 # once: the base model's log-probabilities
    samples, scales = yield from batch.samples_slices(trainer)  # each step: KTO's z0 under the trainer's adapter

The step's loss is ``sft_weight x mean(SFT) + kto_weight x mean(KTO) + dpo_weight x mean(DPO pairs)`` (the means
over the batch's samples of each objective, as TRL's trainers take them; ``alchemist.training.objectives``).
The reference log-probabilities (the base model's, adapter off) never change, so they are computed once per batch
however many epochs train it; KTO's reference point z0 is estimated again before each step, from the batch's
mismatched pairs under the adapter of that step (TRL does so every step too). Both are passes without gradient,
replayed from the prompts' records where that gives their values and recomputed elsewhere
(``alchemist.training.logp_passes``): a mismatched pair from its prompt's record; the base model's pass only from a
record the base model made. The gradient passes replay like any sample's.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

import torch

from alchemist.config.training import ObjectivesConfig
from alchemist.training.lockstep import Lockstep
from alchemist.training.logp_passes import LogpPass, sequence_logps_slices
from alchemist.training.objectives import PreferenceTerm, kto_kl, mismatched
from alchemist.training.trainer import Sample, Trainer


@dataclass(frozen=True)
class Item:
    """One piece of feedback to learn: a prompt, a response, and the objective that learns it."""

    objective: Literal["sft", "kto", "dpo"]
    prompt_ids: list[int]
    response_ids: list[int]  # SFT: what to learn; KTO: the rated response; DPO: the chosen one
    record_id: str | None = None  # the prompt's record, if one was made
    desirable: bool = True  # KTO: a thumbs-up (True) or a thumbs-down
    rejected_ids: list[int] | None = None  # DPO: the rejected response
    seq: int | None = None  # the feedback log entry it comes from


class FeedbackBatch:
    def __init__(self, items: list[Item], weights: ObjectivesConfig, group_size: int = 4) -> None:
        self.weights = weights
        self.group_size = group_size
        self.sft = [i for i in items if i.objective == "sft"]
        self.kto = [i for i in items if i.objective == "kto"]
        self.dpo = [i for i in items if i.objective == "dpo"]
        # KTO's mismatched pairs: prompt j with the completion of the KTO item before it (TRL's rotation), from
        # prompt j's record
        self.kl_pairs = [LogpPass(item.prompt_ids, self.kto[k].response_ids, item.record_id)
                         for item, k in zip(self.kto, mismatched(range(len(self.kto))), strict=True)]  # fmt: skip
        self._ref: list[float] | None = None  # base log-probs: KTO responses, DPO chosen + rejected, KL pairs

    def __len__(self) -> int:
        return len(self.sft) + len(self.kto) + 2 * len(self.dpo)

    def sample_items(self) -> list[Item]:
        """The item of each of ``samples_slices``' samples, in their order (a DPO pair's item twice)."""
        return self.sft + self.kto + [item for item in self.dpo for _ in range(2)]

    def references_slices(self, trainer: Trainer) -> Generator[None, None, None]:
        """The base model's log-probabilities of every preference response (and of KTO's mismatched pairs)."""
        passes = [LogpPass(i.prompt_ids, i.response_ids, i.record_id) for i in self.kto]
        passes += [LogpPass(i.prompt_ids, r, i.record_id)
                   for i in self.dpo for r in (i.response_ids, i.rejected_ids or [])]  # fmt: skip
        self._ref = yield from sequence_logps_slices(trainer, passes + self.kl_pairs, "reference", self.group_size)

    def samples_slices(
        self, trainer: Trainer, lockstep: Lockstep | None = None
    ) -> Generator[None, None, tuple[list[Sample], list[float]]]:
        """The step's samples (SFT, then KTO, then DPO pairs: chosen, rejected) and their loss scales, KTO's z0
        estimated under the trainer's adapter as it is now. With ``lockstep``, this is one replica's part of a
        step over every replica's batch: the means are over all of them (their counts, and KTO's z0 from every
        replica's mismatched pairs)."""
        if self._ref is None:
            yield from self.references_slices(trainer)
        assert self._ref is not None
        w, n_kto = self.weights, len(self.kto)
        n_dpo = 2 * len(self.dpo)
        ref_kto, ref_dpo, ref_kl = self._ref[:n_kto], self._ref[n_kto : n_kto + n_dpo], self._ref[n_kto + n_dpo :]
        counts = [len(self.sft), n_kto, len(self.dpo), sum(item.desirable for item in self.kto)]
        if lockstep is not None:
            counts = [int(n) for n in (yield from lockstep.sum_slices(counts))]
        total_sft, total_kto, total_dpo, total_desirable = counts
        samples = [Sample(i.prompt_ids, i.response_ids, i.record_id) for i in self.sft]
        scales = [w.sft_weight / max(total_sft, 1)] * len(self.sft)
        if total_kto:
            policy_kl = yield from sequence_logps_slices(trainer, self.kl_pairs, "kl", self.group_size)
            if lockstep is None:
                z0 = kto_kl(torch.tensor(policy_kl), torch.tensor(ref_kl)).item()
            else:  # the mean over every replica's pairs, clamped as kto_kl does
                gap, pairs = yield from lockstep.sum_slices([sum(policy_kl) - sum(ref_kl), float(len(policy_kl))])
                z0 = max(gap / pairs, 0.0)
            sides = kto_side_weights(total_desirable, total_kto, w)
            for item, ref in zip(self.kto, ref_kto, strict=True):
                weight = w.kto_weight * sides[item.desirable] / total_kto
                term = PreferenceTerm("kto", ref, weight, w.kto_beta, item.desirable, kl=z0)
                samples.append(Sample(item.prompt_ids, item.response_ids, item.record_id, term=term))
        for pair, item in enumerate(self.dpo):
            assert item.rejected_ids is not None
            weight = w.dpo_weight / total_dpo
            chosen = PreferenceTerm("dpo", ref_dpo[2 * pair], weight, w.dpo_beta, True, pair=pair)
            rejected = PreferenceTerm("dpo", ref_dpo[2 * pair + 1], weight, w.dpo_beta, False, pair=pair)
            samples.append(Sample(item.prompt_ids, item.response_ids, item.record_id, term=chosen))
            samples.append(Sample(item.prompt_ids, item.rejected_ids, item.record_id, term=rejected))
        scales += [0.0] * (len(samples) - len(scales))  # a preference sample's weight is in its term
        return samples, scales


def kto_side_weights(n_desirable: int, n_kto: int, w: ObjectivesConfig) -> dict[bool, float]:
    """The weight of a desirable (True) and of an undesirable (False) KTO sample: ``kto_desirable_weight`` and
    ``kto_undesirable_weight``, balanced (``kto_balance``) so that each side of the batch weighs half, whatever
    its count: the KTO paper (Ethayarajh et al. 2024, section 4.3) recommends w_d n_d / (w_u n_u) in [1, 4/3];
    thumbs-down outnumbering thumbs-up pushed whole answers' probabilities down, which the evaluation gate then
    blocked (docs/benchmarks.md, "Thumbs and pairs"). ``n_desirable`` of the batch's ``n_kto`` KTO samples are
    thumbs-up."""
    sides = {True: w.kto_desirable_weight, False: w.kto_undesirable_weight}
    if w.kto_balance and 0 < n_desirable < n_kto:
        sides[True] *= n_kto / (2 * n_desirable)
        sides[False] *= n_kto / (2 * (n_kto - n_desirable))
    return sides
