"""Data-parallel training: replicas that each train on their own samples take one optimizer step together.

    data_parallel = DataParallel.join(init_method, rank, world_size, model.device, timeout_s)
    trainer = Trainer(model, adapter, store, config, data_parallel=data_parallel)
    step = yield from trainer.step_slices(own_samples)   # on every replica at once, each with its own (maybe none)

A step on every replica (``Trainer.step_slices``): the replicas exchange their sample counts (and adapter versions,
which must agree) -> each computes its own samples' gradients, replayed from its own records or recomputed, each
loss scaled by 1/N with N the GLOBAL count -> a small all-reduce (SUM) of a flag per tensor (whether any replica has
its gradient), the screen's veto and the losses' sum -> unless vetoed, one all-reduce of a flat buffer holding every
LoRA gradient -> every replica then holds the gradient one process would have over the union of the samples, and
clips it, steps AdamW and takes the protected directions out identically: the adapters (and their versions) stay the
same without shipping weights.

Why the count goes first: a loss scaled by 1/N before its backward is what one process does, so the summed
gradient needs no division (and a replica with no sample joins with zero gradients and a count of 0). Given
``loss_scales`` are taken as global ones (a sample's share of the whole step's batch): a caller weighing kinds of
samples computes them from global counts (``sum_slices``). Why the clip comes after the all-reduce: the norm is the
global gradient's, so every replica clips by the same factor. Why the veto is collective: a screen (the poisoning
guard) sees only its replica's samples; if any replica refuses the step, none takes it (each drops its gradients,
and its batch trains again).

The collectives run asynchronously; waiting for them is slices (a replica waiting for a slower one keeps serving).
Their time, from launch to completion seen (serving's turns included, as ``StepResult.step_s``), in two parts: the
meeting points (the count, and the small all-reduce before the gradients), where a replica mostly waits for the
slower one to arrive (``sync_s``), and the gradients' all-reduce, the replicas having met: what moving them costs
(``allreduce_s``; issue 43's goal, docs/benchmarks.md "Scale-out"). Why the small one goes first: a vetoed step moves
no gradient, and the waiting is told apart from the moving.

The process group is the caller's (``join``, or any group handed in): gloo on CPU, nccl on CUDA (``backend_for``).
A collective with a dead peer raises (gloo: at once, its connection closed; else after the group's timeout); forming a
new group is the caller's (``alchemist.training.generations``): this object then works in the new default group.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device``: nccl for CUDA, gloo for the CPU (the one check)."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Reduced:
    """What the replicas agreed on after a step's all-reduce."""

    vetoed: bool  # some replica's screen refused the step (no replica's gradients were kept)
    loss_sum: float  # the sum of every replica's sample losses


class DataParallel:
    """This replica's part in data-parallel steps over ``group`` (the default group if None): its collectives."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.device = device  # where the collectives' buffers live (nccl reduces CUDA tensors only)
        self.group = group
        self.collective_s = 0.0  # all collectives so far, each from launch to completion seen
        self.sync_s = 0.0  # of them, the meeting points': a step's count, and the small collective before its gradients

    # Read from the group at each use: the default group may be formed again (alchemist.training.generations).
    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @classmethod
    def join(cls, init_method: str, rank: int, world_size: int, device: torch.device, timeout_s: float) -> DataParallel:
        """Joins the default process group (``init_method`` a ``tcp://host:port`` or ``file://path`` rendezvous)
        with the backend of ``device``; a collective waits ``timeout_s`` at most for its peers."""
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))  # fmt: skip
        return cls(device)

    def count_slices(self, num_samples: int, version: int, num_values: int) -> Generator[None, None, int]:
        """The step's global sample count; raises (on every replica alike) if the replicas' adapter versions or
        gradient sizes (``num_values``) differ: their steps would not be one step."""
        header = torch.tensor([num_samples, version, num_values], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(header) for _ in range(self.world_size)]
        yield from self._wait_slices(dist.all_gather(gathered, header, group=self.group, async_op=True), sync=True)
        rows = torch.stack(gathered).tolist()  # (world_size, 3)
        if len({(version, size) for _, version, size in rows}) > 1:
            raise RuntimeError(
                f"replicas out of lockstep: (adapter version, gradient values) by rank {[tuple(r[1:]) for r in rows]}"
            )
        return int(sum(count for count, _, _ in rows))

    def sum_slices(self, values: list[float]) -> Generator[None, None, list[float]]:
        """``values`` summed over the replicas (a caller's counts of sample kinds, for global loss scales)."""
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        yield from self._wait_slices(dist.all_reduce(summed, group=self.group, async_op=True))
        return summed.tolist()

    def reduce_slices(
        self, params: Iterable[torch.nn.Parameter], vetoed: bool, loss_sum: float
    ) -> Generator[None, None, Reduced]:
        """Sums the replicas' gradients of ``params`` (already scaled by the global count), unless some replica
        vetoed; each parameter's ``grad`` becomes the sum (None where no replica had one: AdamW then leaves it
        alone, as one process would). Two collectives: first a small one (the vetoes, the loss sums, a flag per
        tensor: whether any replica has its gradient), where the replicas meet, the slower one's backward waited
        for (``sync_s``); then, unless vetoed, the gradients' (``allreduce_s``: what moving them costs)."""
        params = list(params)
        flags = [float(p.grad is not None) for p in params] + [float(vetoed), loss_sum]
        meta = torch.tensor(flags, dtype=torch.float64, device=self.device)  # (params + 2,)
        yield from self._wait_slices(dist.all_reduce(meta, group=self.group, async_op=True), sync=True)
        *present, vetoes, loss_total = meta.tolist()
        if vetoes:
            return Reduced(vetoed=True, loss_sum=loss_total)  # nobody keeps a gradient: none is moved
        dtype = params[0].dtype
        parts = [torch.zeros(p.numel(), dtype=dtype, device=self.device) if p.grad is None else p.grad.reshape(-1)
                 for p in params]  # fmt: skip
        buffer = torch.cat(parts)  # (values,)
        yield from self._wait_slices(dist.all_reduce(buffer, group=self.group, async_op=True))
        start = 0
        for p, has_grad in zip(params, present, strict=True):
            p.grad = buffer[start : start + p.numel()].view_as(p) if has_grad else None
            start += p.numel()
        return Reduced(vetoed=False, loss_sum=loss_total)

    def _wait_slices(self, work: dist.Work, sync: bool = False) -> Generator[None, None, None]:
        """Waits for a collective in slices; adds its time to ``collective_s`` (and to ``sync_s`` where it is a
        meeting point, ``sync``); raises what it raised (a timeout)."""
        t0 = time.perf_counter()
        while not work.is_completed():
            yield
        work.wait()
        elapsed = time.perf_counter() - t0
        self.collective_s += elapsed
        if sync:
            self.sync_s += elapsed
