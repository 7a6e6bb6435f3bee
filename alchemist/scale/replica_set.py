"""The replicas behind the front (``alchemist.scale.front``) as it sees them: which one takes a request, and which
of them train together.

    replicas = ReplicaSet([Handle(i, actor) for i, actor in enumerate(actors)], generations)
    await replicas.watch_forever()                       # every WATCH_S: each replica's info, its state, the group
    handle, why = replicas.pick(conversation)            # a completion's replica; for_feedback, stable: the others'

Where a request goes:

- completions and chat completions: to the replica its conversation was first sent to (the prefix cache holds its
  earlier turns there), unless that one has ``AFFINITY_SLACK`` more requests in flight than the least loaded, then
  to the least loaded. The conversation is its first message (the front names it), hashed by rendezvous over the
  replicas alive, so a replica's death moves only its own conversations.
- feedback: to the replica that served the response (its index is in the response id, ``replica.replica_of``):
  it holds the response and its record. When that replica is not ready, to another (counted as a miss), which
  answers 404 for a response it never served: the feedback logged before, in the shared log, trains wherever.
- everything else (models, the feedback log's reads, adapters, the web pages and the dashboard's series): the first
  replica ready, so that a page's views come from one replica while it lives.

Which replicas train together: whenever the replicas ready to train change (one died, one came back) or one says its
group failed, a new generation of their process group is published (``alchemist.training.generations``); the
replicas move to it at their next round.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from alchemist.scale.replica import ReplicaInfo, replica_of
from alchemist.training.generations import Generations

log = logging.getLogger(__name__)

AFFINITY_SLACK = 4  # requests in flight a conversation's replica may have over the least loaded one
WATCH_S = 0.5  # how often the front asks every replica how it is


@dataclass
class Handle:
    """One replica as the front sees it: its actor, what it last said, and the requests the front has in it."""

    index: int
    actor: object  # the Ray actor handle (alchemist.scale.replica.replica_actor)
    info: ReplicaInfo | None = None
    reachable: bool = False  # its last info() call answered
    in_flight: int = 0
    since_s: float = field(default_factory=time.monotonic)  # when its state last changed

    @property
    def state(self) -> str:
        """``ready`` while it serves, ``starting`` while it loads, ``dead`` while Ray restarts it or it failed."""
        if not self.reachable or self.info is None or self.info.state == "failed":
            return "dead" if self.info is not None or time.monotonic() - self.since_s > 5.0 else "starting"
        return self.info.state

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class NoReplicaError(RuntimeError):
    """No replica is ready to take a request (503)."""


class ReplicaSet:
    """The replicas behind the front, watched every ``WATCH_S``; with ``generations``, the groups they train in."""

    def __init__(self, handles: list[Handle], generations: Generations | None = None) -> None:
        self.handles = handles
        self.generations = generations
        self.registry = CollectorRegistry()
        self.routed = Counter("alchemist:front_requests", "requests passed to a replica, by why it was chosen",
                              ["replica", "reason"], registry=self.registry)  # fmt: skip
        self.feedback = Counter("alchemist:front_feedback", "feedback passed to the replica that served the "
                                "response (hit) or, that one not ready, to another (miss)", ["affinity"],
                                registry=self.registry)  # fmt: skip
        self.cut = Counter("alchemist:front_streams_cut", "streams that ended with an error because their replica "
                           "died", registry=self.registry)  # fmt: skip
        self.states = Gauge("alchemist:front_replicas", "replicas by state", ["state"], registry=self.registry)
        self.generation = Gauge("alchemist:front_training_generation", "the newest generation of the group the "
                                "replicas train in", registry=self.registry)  # fmt: skip

    async def watch_forever(self) -> None:
        while True:
            await self.watch()
            await asyncio.sleep(WATCH_S)

    async def watch(self) -> None:
        await asyncio.gather(*(self._ask(handle) for handle in self.handles))
        for state in ("ready", "starting", "dead"):
            self.states.labels(state).set(sum(h.state == state for h in self.handles))
        self._regroup()

    def _regroup(self) -> None:
        """A new generation of the training group when the replicas ready to train are not its members, or when one
        of them says the group failed under it (a collective timed out: its members may all be alive)."""
        if self.generations is None:
            return
        trainers = [h.info for h in self.handles if h.ready and h.info is not None
                    and not h.info.training.startswith("off")]
        members = [info.index for info in trainers]
        latest = self.generations.latest()
        failed = any(info.broken is not None and info.generation >= latest for info in trainers)
        if members and (members != self.generations.members or failed):
            generation = self.generations.publish(members)
            self.generation.set(generation)
            log.warning("replicas %s train together from now on: generation %d of their group", members, generation)

    async def _ask(self, handle: Handle) -> None:
        before = handle.state
        try:
            info = await asyncio.wait_for(handle.actor.info.remote(), timeout=5.0)
        except Exception:  # RayActorError while it is dead or restarting, a timeout
            handle.reachable = False
        else:
            if handle.info is not None and info.pid != handle.info.pid:
                log.warning("replica %d came back (pid %d, was %d)", handle.index, info.pid, handle.info.pid)
            handle.info, handle.reachable = info, True
        if handle.state != before:
            handle.since_s = time.monotonic()
            log.warning("replica %d: %s -> %s", handle.index, before, handle.state)

    def mark_dead(self, handle: Handle) -> None:
        """Requests to it fail: no more until ``info`` says it serves again."""
        if handle.reachable:
            handle.reachable = False
            handle.since_s = time.monotonic()
            log.warning("replica %d unreachable: marked dead", handle.index)

    def ready(self, excluding: set[int] = frozenset()) -> list[Handle]:
        return [h for h in self.handles if h.ready and h.index not in excluding]

    def pick(self, affinity: str | None, excluding: set[int] = frozenset()) -> tuple[Handle, str]:
        """The replica for a request of conversation ``affinity`` (None: any), and why it was chosen."""
        ready = self.ready(excluding)
        if not ready:
            raise NoReplicaError("no replica is ready to serve (they are starting, or restarting after a failure)")
        least = min(ready, key=lambda h: h.in_flight)
        if affinity is None:
            return least, "least_loaded"
        owner = max(ready, key=lambda h: hashlib.sha256(f"{h.index}:{affinity}".encode()).digest())
        if owner.in_flight <= least.in_flight + AFFINITY_SLACK:
            return owner, "affinity"
        return least, "least_loaded"

    def stable(self, excluding: set[int] = frozenset()) -> Handle:
        """The replica that answers everything but completions and feedback: the first ready one, so that the pages
        and the dashboard's series come from one replica while it lives, not from whichever is least busy."""
        ready = self.ready(excluding)
        if not ready:
            raise NoReplicaError("no replica is ready to serve (they are starting, or restarting after a failure)")
        return ready[0]

    def for_feedback(self, response_id: str, excluding: set[int] = frozenset()) -> Handle:
        index = replica_of(response_id)
        holder = next((h for h in self.handles if h.index == index), None)
        if holder is not None and holder.ready and holder.index not in excluding:
            self.feedback.labels("hit").inc()
            return holder
        self.feedback.labels("miss").inc()
        return self.pick(None, excluding)[0]
