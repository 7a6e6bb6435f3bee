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
- a version is published if any replica settles entries with it (the others publish the same adapter);
- the evaluation gate runs on the leader (rank 0), whose verdict every replica follows; the leader alone rehearses
  (its rehearsal set is read from the shared log, the same on every replica).

A replica's own entries, records, anchors and checkpoint stay its own; its adapter and optimizer state are the
others' exactly, version for version (``DataParallel.count_slices`` refuses a step of replicas out of lockstep).
"""

from __future__ import annotations

import time
from collections.abc import Generator

from alchemist.training.data_parallel import DataParallel

ROUND_S = 1.0  # how often idle replicas ask each other whether a batch is ready


class Lockstep:
    def __init__(self, data_parallel: DataParallel, round_s: float = ROUND_S) -> None:
        self.data_parallel = data_parallel
        self.round_s = round_s
        self._last_round = -float("inf")  # time.monotonic() of the latest round's start

    @property
    def leader(self) -> bool:
        return self.data_parallel.rank == 0

    @property
    def world_size(self) -> int:
        return self.data_parallel.world_size

    def round_due(self) -> bool:
        return time.monotonic() - self._last_round >= self.round_s

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

    def from_leader_slices(self, values: list[float]) -> Generator[None, None, list[float]]:
        """The leader's ``values`` on every replica (the others pass as many of anything)."""
        return (yield from self.sum_slices(values if self.leader else [0.0] * len(values)))
