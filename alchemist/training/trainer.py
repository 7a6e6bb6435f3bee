"""The trainer: one optimizer step of a LoRA adapter over a batch of samples, replaying records where it can.

``Trainer.step_slices`` is the story, top to bottom: fetch each sample's record -> replay it (or recompute the
prompt) -> loss -> backward (accumulated over the batch) -> update (clip, optimizer step, protected directions out)
-> the adapter's version + 1. Where the adapter's ranks are split (``split``), each group's gradients go to its
kind's ranks. Publishing the version is the caller's (``alchemist.training.online``: once per
mini-batch, after its steps and the evaluation gate). Samples go through the model in groups (``group_size`` of them,
``group_max_tokens`` rows at most): a group's replayable samples in one walk, its others in one recompute forward.
With ``data_parallel`` (``alchemist.training.data_parallel``) the step is one of several replicas' together: the
losses are scaled by the global sample count and the gradients all-reduced before the update.

A record is used only if it covers the sample's prompt and is fresh: made with adapter version v, it is used
while the current version <= v + max_staleness (0: exact replay only). Otherwise the sample is recomputed. A pass of
the base model without gradient (``alchemist.training.logp_passes``) may use only a record the base model made
(version 0): ``pinned_record``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import torch

from alchemist.activations.record import Record
from alchemist.activations.store import RecordUnavailable
from alchemist.config import TrainerConfig
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.training.data_parallel import DataParallel
from alchemist.training.hedge import CostModel
from alchemist.training.losses import Targets
from alchemist.training.objectives import PreferenceTerm, preference_loss
from alchemist.training.protected import ProtectedSubspace
from alchemist.training.rank_split import RankSplit
from alchemist.training.recompute import LayerSplitPass, sample_values
from alchemist.training.record_reader import RecordReader
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.seams import RecordSource
from alchemist.training.stats import TrainingStats

T = TypeVar("T")


@dataclass
class Sample:
    """A prompt and the response to learn (served or corrected); ``record_id`` names the prompt's record.
    With ``targets`` (an anchor) the loss is the KL to them on the response positions, not its cross-entropy; with
    ``term``, a preference objective's (``alchemist.training.objectives``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    record_id: str | None = None
    targets: Targets | None = None
    term: PreferenceTerm | None = None  # a preference objective's: its loss is the term's (its scale is unused)

    @property
    def pairs_with_next(self) -> bool:
        """A DPO pair's chosen sample, with the rejected one right after it: the two are trained together."""
        return self.term is not None and self.term.kind == "dpo" and self.term.desirable

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError("a training sample needs a non-empty prompt and response")


@dataclass
class StepResult:
    loss: float  # the mean of the samples' losses (before the update); data-parallel: of every replica's samples
    num_samples: int  # this replica's
    response_tokens: int
    replayed: int
    recomputed: int
    adapter_version: int
    step_s: float  # from the first slice to the last (serving's turns between them included)
    passes: list[tuple[float, bool]]  # each sample's (loss, whether it was replayed), in order
    updated: bool = True  # False: ``screen`` refused the step (gradients dropped, no update); data-parallel: any's
    allreduce_s: float = 0.0  # data-parallel: the gradients' all-reduce, launch to completion, the replicas having met
    sync_s: float = 0.0  # data-parallel: the step's meeting points (DataParallel.sync_s), waits for the others mostly


class Trainer:
    def __init__(
        self,
        model: Llama,
        adapter: LoraAdapter,
        store: RecordSource | None = None,
        config: TrainerConfig | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.store = store
        self.config = config or TrainerConfig()
        c = self.config
        self.optimizer = torch.optim.AdamW(adapter.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)
        self.stats = TrainingStats()  # the OnlineTrainer counts its batches into the same
        self.costs = CostModel()  # measured read and compute speeds, for reload-or-recompute plans
        self.protected: ProtectedSubspace | None = None  # directions each update keeps out of the adapter's A
        self.origin: dict[str, torch.Tensor] | None = None  # an adapter made elsewhere: its A as loaded (project_'s)
        self.split: RankSplit | None = None  # ranks only preference objectives train (alchemist.training.rank_split)
        self.data_parallel = data_parallel  # None: this process's step alone

    def step_slices(
        self,
        samples: list[Sample],
        loss_scales: list[float] | None = None,
        screen: Callable[[list[tuple[float, bool]]], bool] | None = None,
    ) -> Generator[None, None, StepResult]:
        """One optimizer step over ``samples`` (each loss scaled by ``loss_scales``, default 1/N), in slices. Where
        ``screen`` is given, it sees each sample's (loss, replayed) before the update, and False drops the gradients
        instead (no update: the poisoning guard's veto). Data-parallel, every replica calls it at once, with its
        own samples (maybe none): N, the scales and the veto are the step's over all replicas."""
        dp = self.data_parallel
        t0, collective_s, sync_s = time.perf_counter(), dp.collective_s if dp else 0.0, dp.sync_s if dp else 0.0
        num_total, allreduce_s, waited_s = len(samples), 0.0, 0.0
        if dp is not None:  # every replica's count first: the losses are scaled by the global one
            num_values = sum(p.numel() for p in self.adapter.parameters())
            num_total = yield from dp.count_slices(len(samples), self.adapter.version, num_values)
        if not num_total:
            raise ValueError("a training step needs at least one sample")
        scales = loss_scales if loss_scales is not None else [1.0 / num_total] * len(samples)
        passes = yield from self.backward_slices(samples, scales)  # fetch records -> replay or recompute -> loss
        updated = screen is None or screen(passes)
        loss_sum = sum(loss for loss, _ in passes)
        if dp is not None:  # gradients summed over the replicas (vetoes and losses with them), then clipped alike
            reduced = yield from dp.reduce_slices(self.adapter.parameters(), not updated, loss_sum)
            updated, loss_sum = not reduced.vetoed, reduced.loss_sum
            waited_s = dp.sync_s - sync_s
            allreduce_s = dp.collective_s - collective_s - waited_s
            self.stats.allreduce_s += allreduce_s
            self.stats.sync_s += waited_s
            self.stats.last_allreduce_s = allreduce_s
        if updated:
            yield
            self.update()  # clip -> optimizer step -> protected directions out -> version + 1
            yield
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss=loss_sum / num_total,
            num_samples=len(samples),
            response_tokens=sum(len(s.response_ids) for s in samples),
            replayed=sum(replayed for _, replayed in passes),
            recomputed=sum(not replayed for _, replayed in passes),
            adapter_version=self.adapter.version,
            step_s=time.perf_counter() - t0,
            passes=passes,
            updated=updated,
            allreduce_s=allreduce_s,
            sync_s=waited_s,
        )

    def backward_slices(
        self, samples: list[Sample], loss_scales: list[float]
    ) -> Generator[None, None, list[tuple[float, bool]]]:
        """Accumulates the samples' scaled gradients, a group at a time (``groups``), in slices (each group's, and
        a pause between groups); returns each sample's (loss, whether it was replayed)."""
        passes: list[tuple[float, bool]] = []
        for group in self.groups(samples):
            if group.start:
                yield
            preference = samples[group.start].term is not None  # a group is of one kind where ranks are split
            held = self.split.hold(preference) if self.split is not None else None
            # with the corrections' ranks cut (RankSplit.cut), a preference group's answers are out of their scope
            passes += yield from self._group_backward_slices(samples[group], loss_scales[group], not preference)
            if self.split is not None:
                self.split.route(preference, held)  # type: ignore[arg-type]
        return passes

    def groups(self, samples: list[Sample]) -> list[slice]:
        """The batch cut into groups trained together: consecutive samples, at most ``group_size`` of them and
        ``group_max_tokens`` rows (a sample with more rows is a group alone), never between the two samples of a
        DPO pair (which may then exceed both); with ranks split, a preference sample and another never together."""
        c = self.config
        groups, start, rows = [], 0, 0
        for i, sample in enumerate(samples):
            n = len(sample.prompt_ids) + len(sample.response_ids) - 1
            full = i - start >= c.group_size or (c.group_max_tokens and rows + n > c.group_max_tokens)
            if self.split is not None and i > start:
                full = full or (sample.term is None) != (samples[i - 1].term is None)
            if i > start and full and not samples[i - 1].pairs_with_next:
                groups.append(slice(start, i))
                start, rows = i, 0
            rows += n
        if samples:
            groups.append(slice(start, len(samples)))
        return groups

    def _group_backward_slices(
        self, samples: list[Sample], loss_scales: list[float], in_scope: bool = True
    ) -> Generator[None, None, list[tuple[float, bool]]]:
        """Accumulates the scaled gradients of a group of samples trained together: those with a usable record
        replayed in one walk (in slices), the others recomputed in one forward and backward (a layer per slice). Returns
        (loss, whether it was replayed) of each sample."""
        device = self.model.device
        ids = [(torch.tensor(s.prompt_ids, device=device), torch.tensor(s.response_ids, device=device))
               for s in samples]  # fmt: skip
        passes: dict[int, tuple[float, bool]] = {}
        records = {i: record for i, s in enumerate(samples) if (record := self.usable_record(s)) is not None}
        for i, s in enumerate(samples[:-1]):  # a DPO pair is replayed together or recomputed together
            if s.pairs_with_next and (i in records) != (i + 1 in records):
                self.store.release(records.pop(i if i in records else i + 1).record_id)  # type: ignore[union-attr]
        if records:
            replayed = yield from self._replay_group_slices(samples, loss_scales, ids, records, in_scope)
            passes.update({i: (loss, True) for i, loss in (replayed or {}).items()})
        recompute = [i for i in range(len(samples)) if i not in passes]
        if recompute:
            losses = yield from self._recompute_group_slices(
                [samples[i] for i in recompute], [loss_scales[i] for i in recompute], [ids[i] for i in recompute],
                in_scope)
            passes.update({i: (loss, False) for i, loss in zip(recompute, losses, strict=True)})
        for i, sample in enumerate(samples):
            # counted as soon as the group is done: /metrics reads the counters while a batch goes on
            self.stats.count_pass(len(sample.response_ids), passes[i][1], anchor=sample.targets is not None)
        return [passes[i] for i in range(len(samples))]

    def _recompute_group_slices(
        self,
        samples: list[Sample],
        loss_scales: list[float],
        ids: list[tuple[torch.Tensor, torch.Tensor]],
        in_scope: bool = True,
    ) -> Generator[None, None, list[float]]:
        """One forward over the samples and one backward of their scaled losses (a preference objective's over its
        samples' sequence log-probabilities), a layer per slice (``LayerSplitPass``); returns each sample's loss."""
        split = LayerSplitPass(self.model, self.adapter, ids, in_scope)
        hidden = yield from split.forward_slices()
        group = [(*pair, s.targets) for pair, s in zip(ids, samples, strict=True)]
        values = sample_values(self.model, hidden, group, [s.term is not None for s in samples])
        losses = [v.item() if s.term is None else 0.0 for v, s in zip(values, samples, strict=True)]
        total = sum(v * scale for v, s, scale in zip(values, samples, loss_scales, strict=True) if s.term is None)
        preferred = [i for i, s in enumerate(samples) if s.term is not None]
        if preferred:
            objective, own = preference_loss(torch.stack([values[i] for i in preferred]),
                                             [samples[i].term for i in preferred])  # type: ignore[misc]  # fmt: skip
            total = total + objective
            for i, loss in zip(preferred, own, strict=True):
                losses[i] = loss
        yield from split.backward_slices(total)  # type: ignore[arg-type]
        return losses

    def _replay_group_slices(
        self,
        samples: list[Sample],
        loss_scales: list[float],
        ids: list[tuple[torch.Tensor, torch.Tensor]],
        records: dict[int, Record],
        in_scope: bool = True,
    ) -> Generator[None, None, dict[int, float] | None]:
        """Replays the samples with (pinned) ``records`` together; returns their losses by index, or None if a
        record on disk went bad mid-read (no gradient of the group is kept then: the caller recomputes them)."""
        walk_rows = sum(len(samples[i].prompt_ids) - 1 + len(samples[i].response_ids) for i in records)
        readers: dict[int, RecordReader] = {}
        kept = None
        try:
            for i, record in records.items():
                readers[i] = RecordReader(
                    self.store, record, self.model, self.adapter, len(samples[i].prompt_ids) - 1, self.costs,
                    self.stats, self.config.prefetch_depth, num_live=len(samples[i].response_ids), walk_rows=walk_rows,
                )  # fmt: skip
            # Only a file can fail mid-read (a pinned record never moves): keep the gradients to go back to then.
            if any(reader.tier == "disk" for reader in readers.values()):
                kept = [None if p.grad is None else p.grad.clone() for p in self.adapter.parameters()]
            replay = [
                ReplaySample(*ids[i], reader.forward_layer, reader.walk_layer, loss_scales[i], samples[i].targets,
                             samples[i].term)  # fmt: skip
                for i, reader in readers.items()
            ]
            walk = replay_backward_slices(self.model, self.adapter, replay, in_scope)
            losses = yield from _paused_timed_slices(walk, readers)
        except RecordUnavailable:  # a damaged file: never train on part of it
            if kept is None:
                raise
            for p, g in zip(self.adapter.parameters(), kept, strict=True):
                p.grad = g
            self.stats.unreadable += 1
            return None
        finally:
            for reader in readers.values():
                reader.close()
            for record in records.values():
                self.store.release(record.record_id)
        self.stats.staleness_used.update(self.adapter.version - records[i].adapter_version for i in records)
        return dict(zip(records, losses, strict=True))

    def usable_record(self, sample: Sample) -> Record | None:
        """The sample's record, pinned, if it covers the prompt and is fresh enough; else None (counted)."""
        found = self.pinned_record(sample.record_id, sample.prompt_ids)
        self.stats.missing += found == "missing"
        self.stats.stale += found == "stale"
        return found if isinstance(found, Record) else None

    def pinned_record(self, record_id: str | None, prompt_ids: list[int], base: bool = False) -> Record | str:
        """The record, pinned, if it covers the prompt and its layer inputs are close enough to those of the
        policy of the pass: the adapter's (made at most ``max_staleness`` versions ago), or with ``base`` the base
        model's (made by it: version 0, exact only); else why not ("off", "missing", "stale", "gone")."""
        if not self.config.replay or self.store is None or record_id is None:
            return "off"
        record = self.store.lookup(record_id)
        if record is None or not record.covers(prompt_ids, len(prompt_ids) - 1):
            return "missing"
        if base:  # version 0 is the base model serving: its layer inputs are the base model's
            fresh = record.adapter_version == 0
        else:
            fresh = self.adapter.version <= record.adapter_version + self.config.max_staleness
        if not fresh:
            return "stale"
        return record if self.store.pin(record.record_id) else "gone"

    def update(self) -> None:
        """The accumulated gradients, clipped, become an optimizer step; the adapter's A then loses the protected
        directions (if any) and its version goes up by one."""
        if self.config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.protected is not None:
            self.protected.project_(self.adapter, self.split, self.origin)
        self.adapter.version += 1
        self.stats.steps += 1


def _paused_timed_slices(
    slices: Generator[None, None, T], readers: dict[int, RecordReader]
) -> Generator[None, None, T]:
    """Passes the replay's slices on, telling the readers how long each pause (serving's turn) lasted."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
        paused = time.perf_counter()
        yield
        for reader in readers.values():
            reader.paused_for(time.perf_counter() - paused)
