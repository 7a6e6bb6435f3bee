"""Test helpers: the same optimizer steps taken by one process over every sample, or by replicas (processes of a
gloo group) each over its share; what each saw, for tests/training/test_data_parallel.py to compare."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

from alchemist.activations.store import ActivationStore
from alchemist.model.loader import build_model
from alchemist.training.data_parallel import DataParallel
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.training.recording import record_alone
from tests.training.test_replay import lora_with_nonzero_b

# Small enough that every step's gradient is clipped: clipping a replica's part instead of the sum would show.
MAX_GRAD_NORM = 1e-3


@dataclass
class Case:
    """Steps over ``samples`` (prompt, response pairs), in ``dtype``: replayed from records or recomputed;
    ``shares[r]`` of them (consecutive) on replica r; ``scales`` given (global) or the default 1/N; ``vetoes[r]``:
    replica r's screen refuses the first step."""

    replay: bool
    shares: list[int]
    scales: list[float] | None = None
    vetoes: list[bool] = field(default_factory=list)
    num_steps: int = 2
    dtype: torch.dtype = torch.float32  # the model's, the adapter's and the records'


@dataclass
class Steps:
    """What a trainer saw: per step, the gradients the update got (before clipping) and the adapter after it."""

    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    adapters: list[dict[str, torch.Tensor]] = field(default_factory=list)
    updated: list[bool] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    replayed: int = 0
    versions: list[int] = field(default_factory=list)
    allreduce_s: list[float] = field(default_factory=list)  # per step: the gradients' all-reduce
    sync_s: float = 0.0  # the steps' meeting points (their counts, their vetoes)


def take_steps(
    model, case: Case, samples: list[tuple[list[int], list[int]]], first: int = 0,
    data_parallel: DataParallel | None = None, veto: bool = False,
) -> Steps:  # fmt: skip
    """``case.num_steps`` steps over ``samples`` (the ``first``-th on: their record ids), from the same adapter, on
    ``model`` (in ``case.dtype``)."""
    adapter = lora_with_nonzero_b(model).to(model.dtype)
    store = ActivationStore(budget_bytes=1 << 30) if case.replay else None
    batch = []
    for i, (prompt, response) in enumerate(samples, start=first):
        if store is not None:
            store.put(record_alone(model, adapter, torch.tensor(prompt), model.dtype, record_id=f"r{i}"))
        batch.append(Sample(prompt, response, record_id=f"r{i}"))
    config = TrainerConfig(lr=1e-2, max_grad_norm=MAX_GRAD_NORM, max_staleness=case.num_steps, replay=case.replay)
    trainer = Trainer(model, adapter, store, config, data_parallel)
    seen = Steps()
    update = trainer.update

    def seen_update() -> None:  # the gradients the update gets: all-reduced where data-parallel, not yet clipped
        seen.grads.append({n: p.grad.detach().clone() for n, p in adapter.named_parameters() if p.grad is not None})
        update()

    trainer.update = seen_update
    scales = None if case.scales is None else case.scales[first : first + len(samples)]
    for step in range(case.num_steps):
        screen = (lambda passes: not veto) if step == 0 else None
        result = run_to_end(trainer.step_slices(batch, scales, screen))
        if not result.updated:
            seen.grads.append({})
        seen.adapters.append({n: p.detach().clone() for n, p in adapter.named_parameters()})
        seen.updated.append(result.updated)
        seen.losses.append(result.loss)
        seen.versions.append(adapter.version)
        seen.allreduce_s.append(result.allreduce_s)
    seen.replayed, seen.sync_s = trainer.stats.replayed, trainer.stats.sync_s
    return seen


def _replica(rank: int, world_size: int, rendezvous: str, model_dir: Path, cases: dict[str, Case], samples,
             out_dir: str) -> None:  # fmt: skip
    torch.set_num_threads(1)  # two replicas on a shared 2-core machine
    data_parallel = DataParallel.join(rendezvous, rank, world_size, torch.device("cpu"), timeout_s=60)
    models = {dtype: build_model(model_dir, dtype) for dtype in {case.dtype for case in cases.values()}}
    seen = {}
    for name, case in cases.items():
        first = sum(case.shares[:rank])
        own = samples[first : first + case.shares[rank]]
        veto = bool(case.vetoes) and case.vetoes[rank]
        seen[name] = take_steps(models[case.dtype], case, own, first, data_parallel, veto)
    seen["sums"] = run_to_end(data_parallel.sum_slices([rank + 1.0, 0.5]))
    try:  # replicas at different adapter versions: every one refuses the step
        run_to_end(data_parallel.count_slices(1, rank, 10))
    except RuntimeError as refused:
        seen["out of lockstep"] = str(refused)
    torch.save(seen, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def run_replicas(
    tmp_path: Path, model_dir: Path, cases: dict[str, Case], samples, timeout_s: float = 120.0
) -> list[dict[str, Steps]]:
    """Every case's steps on ``world_size`` replicas (spawned processes, a gloo group through a file in
    ``tmp_path``); what each replica saw, by rank (and under "sums" and "out of lockstep", what ``sum_slices`` and
    ``count_slices`` answered)."""
    world_size = len(next(iter(cases.values())).shares)
    args = (world_size, f"file://{tmp_path / 'rendezvous'}", Path(model_dir), cases, samples, str(tmp_path))
    context = mp.start_processes(_replica, args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"replicas still running after {timeout_s} s")
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
