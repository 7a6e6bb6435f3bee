"""Lockstep: the online loop of several replicas as one, each training on its own feedback.

    lockstep = Lockstep(data_parallel)                      # alchemist.training.data_parallel, joined
    online = OnlineTrainer.from_config(..., lockstep=lockstep)
    busy = yield from lockstep.any_slices(bool(own_batch))  # every replica asks the same questions, in order

Data-parallel steps (``DataParallel``) make one step of every replica's samples; the loop around them must also
decide alike on every replica, or one would step while another waits for it. Every decision the loop takes from
what one replica sees is taken here from all of them, with one small all-reduce each:

- a round, every ``ROUND_S``: a batch starts if any replica has one ready (the others join with none);
- each kind of sample's count, for the loss scales (a correction weighs what it weighs in one process's batch of the
  union), and KTO's reference point from every replica's mismatched pairs;
- the steps end when every replica's corrections are learned, or when any replica's backlog says yield;
- each replica's anchors (its own traffic's) come in a turn N times longer, so that a step over all of them holds
  as many as one process's;
- a version is published if any replica settles entries with it (the others publish the same adapter), and it
  serves every replica's corrections to the requests like their prompts (alchemist.engine.router), not only its
  own;
- the evaluation gate runs on the leader (rank 0), whose verdict every replica follows; the leader alone rehearses
  (its rehearsal set is read from the shared log, the same on every replica).

A replica's own entries, records, anchors and checkpoint stay its own; its adapter and optimizer state are the
others' exactly, version for version (``DataParallel.count_slices`` refuses a step of replicas out of lockstep).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator

import torch.distributed as dist

from alchemist.training.data_parallel import DataParallel

logger = logging.getLogger(__name__)

ROUND_S = 1.0  # how often idle replicas ask each other whether a batch is ready


class Lockstep:
    def __init__(self, data_parallel: DataParallel, round_s: float = ROUND_S) -> None:
        self.data_parallel = data_parallel
        self.round_s = round_s
        self._last_round = -float("inf")  # time.monotonic() of the latest round's start
        self.broken: str | None = None  # why training stopped: a collective failed (a replica died)

    def fail(self, error: BaseException) -> None:
        """A collective failed: the group lost a member (or timed out) and cannot be used again. Training stops
        here; serving goes on. (Forming a new group with the replicas alive, and taking back a restarted one, is
        not built yet.)"""
        if self.broken is None:
            self.broken = f"{type(error).__name__}: {error}"
            logger.error("training in lockstep stopped: the replicas' group failed (%s); serving goes on, feedback "
                         "stays queued", self.broken)  # fmt: skip

    @property
    def leader(self) -> bool:
        return self.data_parallel.rank == 0

    @property
    def world_size(self) -> int:
        return self.data_parallel.world_size

    def round_due(self) -> bool:
        return self.broken is None and time.monotonic() - self._last_round >= self.round_s

    def start_round(self) -> None:
        self._last_round = time.monotonic()

    def sum_slices(self, values: list[float]) -> Generator[None, None, list[float]]:
        """``values`` summed over the replicas."""
        return (yield from self.data_parallel.sum_slices(values))

    def any_slices(self, flag: bool) -> Generator[None, None, bool]:
        (total,) = yield from self.sum_slices([float(flag)])
        return total > 0

    def all_slices(self, flag: bool) -> Generator[None, None, bool]:
        (total,) = yield from self.sum_slices([float(flag)])
        return total == self.world_size

    def gather_slices(self, obj: object) -> Generator[None, None, list[object]]:
        """Every replica's ``obj`` (picklable), by rank. The exchange itself blocks, so the replicas first meet in
        an asynchronous all-reduce: then it only waits for bytes, not for a replica that is still serving."""
        yield from self.sum_slices([0.0])
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.data_parallel.group)
        return gathered

    def from_leader_slices(self, values: list[float]) -> Generator[None, None, list[float]]:
        """The leader's ``values`` on every replica (the others pass as many of anything)."""
        return (yield from self.sum_slices(values if self.leader else [0.0] * len(values)))
