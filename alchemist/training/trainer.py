"""The trainer: one optimizer step of a LoRA adapter over a batch of samples, replaying records where it can.

``Trainer.step`` reads as the story: fetch each sample's record -> replay it (or recompute the prompt) ->
loss -> backward (accumulated over the batch) -> clip -> update -> bump the adapter version.

A record is used only if it covers the sample's prompt and is fresh: made with adapter version v, it is used
while the current version <= v + max_staleness (0: exact replay only). Otherwise the sample is recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from alchemist.activations.record import Record
from alchemist.activations.store import ActivationStore, RecordUnavailable
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.training.hedge import CostModel
from alchemist.training.losses import Targets
from alchemist.training.recompute import recompute_loss
from alchemist.training.record_reader import RecordReader
from alchemist.training.replay import replay_backward_slices, run_to_end


@dataclass
class TrainerConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # 0 disables clipping
    max_staleness: int = 0  # adapter versions a record may lag behind and still be replayed
    replay: bool = True  # False: always recompute (the separate-trainer baseline)
    prefetch_depth: int = 2  # record layers read ahead of the replay walk (0: read in the walk's thread)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive (got {self.lr})")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (got {self.max_staleness})")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (got {self.max_grad_norm})")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0 (got {self.prefetch_depth})")


@dataclass
class Sample:
    """A prompt and the response to learn (served or corrected); ``record_id`` names the prompt's record.
    With ``targets`` (an anchor) the loss is the KL to them on the response positions, not its cross-entropy."""

    prompt_ids: list[int]
    response_ids: list[int]
    record_id: str | None = None
    targets: Targets | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError("a training sample needs a non-empty prompt and response")


@dataclass
class TrainerStats:
    steps: int = 0
    samples: int = 0
    response_tokens: int = 0
    replayed: int = 0
    recomputed: int = 0
    stale: int = 0  # records found but too old for the current adapter (recomputed)
    missing: int = 0  # no record, or one that does not cover the prompt (recomputed)
    staleness_used: list[int] = field(default_factory=list)  # versions behind, of each replayed record
    unreadable: int = 0  # replays abandoned because the record went bad or away mid-read (then recomputed)
    layers_reloaded: int = 0  # walk layers read back from the store
    layers_recomputed: int = 0  # walk layers recomputed from their recorded input instead (hedging)
    record_bytes_read: int = 0


@dataclass
class StepResult:
    loss: float
    num_samples: int
    response_tokens: int
    replayed: int
    recomputed: int
    adapter_version: int
    step_s: float


class Trainer:
    def __init__(
        self,
        model: Llama,
        adapter: LoraAdapter,
        store: ActivationStore | None = None,
        config: TrainerConfig | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.store = store
        self.config = config or TrainerConfig()
        c = self.config
        self.optimizer = torch.optim.AdamW(adapter.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)
        self.stats = TrainerStats()
        self.costs = CostModel()  # measured read and compute speeds, for reload-or-recompute plans

    def step(self, samples: list[Sample]) -> StepResult:
        if not samples:
            raise ValueError("a training step needs at least one sample")
        t0 = time.perf_counter()
        replayed = 0
        total_loss = 0.0
        for sample in samples:
            loss, was_replayed = self.backward(sample, loss_scale=1.0 / len(samples))
            replayed += was_replayed
            total_loss += loss / len(samples)
        self.update()
        return StepResult(
            loss=total_loss,
            num_samples=len(samples),
            response_tokens=sum(len(s.response_ids) for s in samples),
            replayed=replayed,
            recomputed=len(samples) - replayed,
            adapter_version=self.adapter.version,
            step_s=time.perf_counter() - t0,
        )

    def backward(self, sample: Sample, loss_scale: float = 1.0) -> tuple[float, bool]:
        """Accumulates one sample's scaled gradient; returns (its loss, whether it was replayed)."""
        return run_to_end(self.backward_slices(sample, loss_scale))

    def backward_slices(self, sample: Sample, loss_scale: float = 1.0) -> Generator[None, None, tuple[float, bool]]:
        """``backward`` in slices (one per layer of a replay; a recompute is one slice): yields where serving may
        preempt training, returns (the sample's loss, whether it was replayed)."""
        device = self.model.device
        prompt = torch.tensor(sample.prompt_ids, device=device)
        response = torch.tensor(sample.response_ids, device=device)
        self.stats.samples += 1
        self.stats.response_tokens += len(sample.response_ids)
        record = self.usable_record(sample)
        if record is not None:
            reader = RecordReader(
                self.store, record, self.model, self.adapter, len(prompt) - 1, self.costs, self.stats,
                self.config.prefetch_depth, num_live=len(response),
            )  # fmt: skip
            # Only a file can fail mid-read (a pinned record never moves): keep the gradients to go back to then.
            kept = None
            if reader.tier == "disk":
                kept = [None if p.grad is None else p.grad.clone() for p in self.adapter.parameters()]
            try:
                slices = replay_backward_slices(
                    self.model, self.adapter, reader.forward_layer, prompt, response, loss_scale, reader.walk_layer,
                    sample.targets,
                )  # fmt: skip
                loss_value = yield from _paused_timed(slices, reader)
                self.stats.replayed += 1
                self.stats.staleness_used.append(self.adapter.version - record.adapter_version)
                return loss_value, True
            except RecordUnavailable:  # a damaged file: never train on part of it
                if kept is None:
                    raise
                for p, g in zip(self.adapter.parameters(), kept, strict=True):
                    p.grad = g
                self.stats.unreadable += 1
            finally:
                reader.close()
                self.store.release(record.record_id)
        self.stats.recomputed += 1
        loss = recompute_loss(self.model, self.adapter, prompt, response, sample.targets)
        (loss * loss_scale).backward()
        return loss.item(), False

    def usable_record(self, sample: Sample) -> Record | None:
        """The sample's record, pinned, if it covers the prompt and is fresh enough; else None (counted)."""
        if not self.config.replay or self.store is None or sample.record_id is None:
            return None
        record = self.store.lookup(sample.record_id)
        if record is None or not record.covers(sample.prompt_ids, len(sample.prompt_ids) - 1):
            self.stats.missing += 1
            return None
        if self.adapter.version > record.adapter_version + self.config.max_staleness:
            self.stats.stale += 1
            return None
        return record if self.store.pin(record.record_id) else None

    def update(self) -> None:
        if self.config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.adapter.version += 1
        self.stats.steps += 1


def _paused_timed(slices: Generator[None, None, float], reader: RecordReader) -> Generator[None, None, float]:
    """Passes the replay's slices on, telling the reader how long each pause (serving's turn) lasted."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
        paused = time.perf_counter()
        yield
        reader.paused_for(time.perf_counter() - paused)
