"""The training steps `alchemist bench memory` measures: recompute, and replay of a record held in the store's
device tier or moved to its disk tier, each through the trainer's own path.

A step is ``Trainer.backward`` of one sample (store lookup, pin, the prefetch window, the reload-or-recompute plan,
the layer walk), then the gradients are zeroed. The optimizer never steps, so the adapter stays the version the
record was made with and every replay is exact (and ``max_staleness=0``: a changed adapter makes the trainer
recompute instead). Each step checks the trainer's counters and the record's tier, so a "replay" that silently
recomputed, or read from another tier, raises instead of being measured.

    steps = StepSet(model, 1024, 128, ("recompute", "replay_disk"), torch.bfloat16)
    steps["replay_disk"]()  # one step, replayed from the record's file
    steps.close()
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from alchemist.activations import disk
from alchemist.activations.record import Record
from alchemist.activations.store import ActivationStore
from alchemist.bench.training import record_prefill
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig

RECORD_ID = "bench-memory"
# Modes: "recompute", "replay_memory" (device tier), and any name starting with "replay_disk" (the disk tier; all
# such modes share one store and file, each with its own trainer and so its own measured costs).
MODES = ("recompute", "replay_memory", "replay_disk")
_READ_CHUNK_BYTES = 16 << 20


@dataclasses.dataclass
class TrainingStep:
    """One mode's step: backward of the sample, gradients zeroed, the trainer's counters checked."""

    name: str
    trainer: Trainer
    sample: Sample
    tier: str | None  # the store tier the record must be read from; None: the step recomputes

    def __call__(self) -> None:
        stats, store = self.trainer.stats, self.trainer.store
        if self.tier is not None and (tier := store.tier_of(RECORD_ID)) != self.tier:
            raise RuntimeError(f"{self.name}: the record is in the {tier} tier, not {self.tier}")
        before = (stats.replayed, stats.recomputed)
        run_to_end(self.trainer.backward_slices([self.sample], [1.0]))
        self.trainer.optimizer.zero_grad(set_to_none=True)
        done = (stats.replayed - before[0], stats.recomputed - before[1])
        expected = (0, 1) if self.tier is None else (1, 0)
        if done != expected:
            raise RuntimeError(f"{self.name}: (replayed, recomputed) = {done}, expected {expected}")


class StepSet:
    """The steps of ``modes`` for one (P, R) shape on ``model``: one random sample, one LoRA adapter and (for the
    replay modes) the sample's record made by a serving prefill. Close it to drop the stores and the record file."""

    def __init__(
        self,
        model: Llama,
        num_prompt: int,
        num_response: int,
        modes: Iterable[str],
        record_dtype: torch.dtype = torch.bfloat16,
        prefetch_depth: int = TrainerConfig.prefetch_depth,
        lora_r: int = 16,
        record_dir: str | Path | None = None,
        tokens: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """``tokens``: the sample's (prompt, response) ids, ``num_prompt`` and ``num_response`` long (default:
        random ids)."""
        modes = list(modes)
        for mode in modes:
            if mode not in ("recompute", "replay_memory") and not mode.startswith("replay_disk"):
                raise ValueError(f"unknown mode {mode!r} (one of {MODES})")
        if tokens is None:
            g = torch.Generator().manual_seed(num_prompt * 7 + num_response)
            prompt = torch.randint(0, model.config.vocab_size, (num_prompt,), generator=g)
            response = torch.randint(0, model.config.vocab_size, (num_response,), generator=g)
        else:
            prompt, response = torch.tensor(tokens[0]), torch.tensor(tokens[1])
            if (len(prompt), len(response)) != (num_prompt, num_response):
                raise ValueError(f"tokens are {len(prompt)}x{len(response)}, not {num_prompt}x{num_response}")
        self.sample = Sample(prompt.tolist(), response.tolist(), RECORD_ID)
        adapter = LoraAdapter(model.config, LoraConfig(r=lora_r, alpha=2.0 * lora_r), seed=0)
        config = TrainerConfig(prefetch_depth=prefetch_depth, max_staleness=0)  # exact replays only (see above)
        self.steps: dict[str, TrainingStep] = {}
        self.stores: list[ActivationStore] = []
        self.record_bytes = 0
        self.file: Path | None = None  # the record's file, with a disk mode
        self._dir: tempfile.TemporaryDirectory | None = None
        if "recompute" in modes:
            trainer = Trainer(model, adapter, None, dataclasses.replace(config, replay=False))
            self.steps["recompute"] = TrainingStep("recompute", trainer, self.sample, None)
        disk_modes = [m for m in modes if m.startswith("replay_disk")]
        if "replay_memory" not in modes and not disk_modes:
            return
        record = record_prefill(model, adapter, prompt, record_dtype, RECORD_ID)
        self.record_bytes = record.nbytes
        if "replay_memory" in modes:
            store = self._store(record.nbytes)
            if not store.put(record):
                raise RuntimeError("the in-memory store rejected the record")
            trainer = Trainer(model, adapter, store, config)
            self.steps["replay_memory"] = TrainingStep("replay_memory", trainer, self.sample, "device")
        if disk_modes:
            self._dir = tempfile.TemporaryDirectory(prefix="alchemist-bench-memory-", dir=record_dir)
            store = self._offloaded(record, Path(self._dir.name))
            self.file = next(Path(self._dir.name).glob(f"*{disk.SUFFIX}"))
            for mode in disk_modes:
                self.steps[mode] = TrainingStep(mode, Trainer(model, adapter, store, config), self.sample, "disk")

    def __getitem__(self, mode: str) -> TrainingStep:
        return self.steps[mode]

    def close(self) -> None:
        for store in self.stores:
            store.close()
        if self._dir is not None:
            self._dir.cleanup()

    def _store(self, budget_bytes: int, **budgets) -> ActivationStore:
        store = ActivationStore(budget_bytes, ttl_s=float("inf"), **budgets)
        self.stores.append(store)
        return store

    def _offloaded(self, record: Record, disk_dir: Path) -> ActivationStore:
        """A store whose device tier holds exactly the record: the put fills it past its write-back mark, so the
        store writes the record to disk (its own background write) and drops it from memory."""
        disk_bytes = disk.file_bytes_bound(record.layers)
        store = self._store(record.nbytes, disk_budget_bytes=disk_bytes, disk_dir=disk_dir)
        if not store.put(record):
            raise RuntimeError("the offloading store rejected the record")
        store.flush()
        if store.tier_of(RECORD_ID) != "disk":
            raise RuntimeError(f"the record stayed in the {store.tier_of(RECORD_ID)} tier (disk write failed?)")
        return store


def drop_from_page_cache(path: Path) -> None:
    """Evicts the file's pages from the page cache (written back first: dirty pages are not dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_s(path: Path) -> float:
    """Seconds to read the whole file once, in large chunks into one buffer."""
    buffer = bytearray(_READ_CHUNK_BYTES)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start
