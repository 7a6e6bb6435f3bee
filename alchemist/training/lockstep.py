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
  (its rehearsal set is read from the shared log, the same on every replica);
- a rollback asked of any replica is made by all, at a round's start.

A replica's own entries, records, anchors and checkpoint stay its own; its adapter and optimizer state are the
others' exactly, version for version (``DataParallel.count_slices`` refuses a step of replicas out of lockstep).

The group changes (``generations``: ``alchemist.training.generations``): a replica that dies breaks it (the
collective in flight fails on the others: their batch is dropped, its entries stay queued, ``fail``), and a
coordinator publishes a newer generation of the replicas alive; a restarted or added one joins a generation too.
Replicas move to a newer generation together, at a round's start (its one all-reduce carries whether any has seen
one), and once it has formed, the members behind the one furthest along (a restarted replica resumes from its own
last checkpoint) take its adapter and optimizer state (``catch_up_slices``): every member then trains from the
current version. Without ``generations`` the group is the caller's, fixed: a failure stops training for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator

import torch.distributed as dist

from alchemist.training.data_parallel import DataParallel
from alchemist.training.generations import Generations

logger = logging.getLogger(__name__)

ROUND_S = 1.0  # how often idle replicas ask each other whether a batch is ready


class Lockstep:
    def __init__(
        self,
        data_parallel: DataParallel,
        round_s: float = ROUND_S,
        generations: Generations | None = None,
        index: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        """``data_parallel``: this replica's collectives, in the default group: the caller's, formed already, or
        (``generations``) each generation's that has this replica (``index``) as a member, each collective waiting
        ``timeout_s`` at most for a peer."""
        self.data_parallel = data_parallel
        self.round_s = round_s
        self.generations, self.index, self.timeout_s = generations, index, timeout_s
        self.generation = 0  # of the group this replica is (or was last) in; 0: none yet, or the caller's
        self.joined = generations is None  # in a working group
        self.broken: str | None = None  # why its last group failed (a replica died, a collective timed out)
        self._last_round = -float("inf")  # time.monotonic() of the latest round's start
        self._looked_s, self._to_form = -float("inf"), None  # out of a group: when the store was last asked, answer

    def fail(self, error: BaseException) -> None:
        """A collective failed: the group lost a member (or timed out) and cannot be used again. This replica's
        training waits for a newer generation (without ``generations``, it stops for good); serving goes on."""
        self.joined = False
        self.broken = f"{type(error).__name__}: {error}"
        logger.error("training in lockstep stopped: the replicas' group (generation %d) failed (%s); serving goes "
                     "on, feedback stays queued until a new group forms", self.generation, self.broken)  # fmt: skip

    @property
    def leader(self) -> bool:
        return self.data_parallel.rank == 0

    @property
    def world_size(self) -> int:
        return self.data_parallel.world_size

    def due(self) -> bool:
        """Whether the loop has lockstep work now: a round with the others (every ``round_s``), or, out of a group,
        forming a newer generation's that has this replica (looked for as often)."""
        now = time.monotonic()
        if now - self._last_round < self.round_s:
            return False
        if self.joined:
            return True
        if now - self._looked_s >= self.round_s:  # the store is asked once a round at most (this is asked often)
            self._looked_s, self._to_form = now, self._generation_to_form()
        return self._to_form is not None

    def start_round(self) -> None:
        self._last_round = time.monotonic()

    def round_slices(self, ready: bool, rollback: bool) -> Generator[None, None, tuple[bool, bool]]:
        """A round's start, on every member: whether any has a batch ``ready``, and whether any was asked a
        ``rollback`` (then that comes first). If any has seen a newer generation, neither: they all leave for it
        (``joined`` False; ``form_slices`` next)."""
        newer = self.generations is not None and self.generations.latest() > self.generation
        busy, rollbacks, leave = yield from self.sum_slices([float(ready), float(rollback), float(newer)])
        if leave:
            self.joined = False
            return False, False
        return busy > 0, rollbacks > 0

    def form_slices(self) -> Generator[None, None, bool]:
        """Forms the newest generation's group if this replica is a member (in a thread: the others may take a
        while to come, and serving goes on meanwhile); returns whether it is in a working group now."""
        generation, self._to_form = self._generation_to_form(), None
        if generation is None:
            return False
        assert self.generations is not None
        errors: list[BaseException] = []

        def form() -> None:
            try:
                self.generations.form(generation, self.index, self.data_parallel.device, self.timeout_s)
            except BaseException as e:  # a member that never came (it died meanwhile): a later generation
                errors.append(e)

        thread = threading.Thread(target=form, name="lockstep-form", daemon=True)
        thread.start()
        while thread.is_alive():
            yield
        self.generation = generation
        if errors:
            self.fail(errors[0])
            return False
        self.joined, self.broken = True, None
        logger.info("training in lockstep: generation %d formed, rank %d of %d", generation, self.data_parallel.rank,
                    self.world_size)  # fmt: skip
        return True

    def catch_up_slices(self, version: int, state: Callable[[], object]) -> Generator[None, None, object | None]:
        """Just formed: the state (``state()``) of the member furthest along (the highest adapter ``version``, the
        first rank of those), for each member behind it; None for the others (nothing to take)."""
        versions = yield from self.gather_slices(version)
        source = versions.index(max(versions))  # type: ignore[type-var]
        if all(v == versions[source] for v in versions):
            return None
        box = [state() if self.data_parallel.rank == source else None]
        dist.broadcast_object_list(box, src=source, group=self.data_parallel.group)  # the members just met
        return box[0] if version != versions[source] else None

    def _generation_to_form(self) -> int | None:
        """The newest generation, if it is newer than this replica's last and has it as a member."""
        if self.generations is None:
            return None
        latest = self.generations.latest()
        if latest <= self.generation or self.index not in self.generations.members_of(latest):
            return None
        return latest

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
