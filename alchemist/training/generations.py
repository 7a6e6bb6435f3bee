"""Generations of the replicas' process group: formed again whenever the replicas that train change.

    generations = Generations.host("10.0.0.5")       # the coordinator (the front): the store every replica reaches
    generations.publish([0, 2])                        # generation g + 1: replicas 0 and 2, ranks by that order
    member = Generations.connect(generations.address)  # a replica
    g = member.latest()                                # the newest generation (0: none yet)
    if member.index_in(g, my_index) is not None:
        member.form(g, my_index, device, timeout_s)    # leaves the group it was in, forms generation g's

Why generations: a process group does not survive a member's death (a collective with a dead peer fails on the
others; ``gloo`` notices the closed connection at once), and it cannot take a member in later. So the group is
formed again, each time under a new key prefix of one ``TCPStore``: by the survivors when a replica dies, with a
restarted (or added) replica when it is ready. The store lives in the coordinator's process, not in a replica that
may die, and the coordinator decides who is in each generation (the front sees which replicas are alive);
``alchemist.training.lockstep`` decides when the replicas move to the newest one (together, at a round's start).

Keys: ``generation`` (a counter: ``add`` reads and bumps it atomically) and ``members/G`` (the replica indices of
generation G, comma-separated), written before the counter moves on, so a member that sees G finds its list.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from alchemist.training.data_parallel import backend_for

STORE_TIMEOUT_S = 30.0  # a store operation waits at most this for the coordinator


class Generations:
    def __init__(self, store: dist.TCPStore, address: str) -> None:
        self.store = store
        self.address = address  # host:port of the store
        self._members: list[int] = []  # the coordinator's newest generation's

    @classmethod
    def host(cls, host: str) -> Generations:
        """The coordinator's side: a store on ``host`` and a free port, in this process, for as long as it lives."""
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S))  # fmt: skip
        return cls(store, f"{host}:{store.port}")

    @classmethod
    def connect(cls, address: str) -> Generations:
        """A member's side: the coordinator's store at ``address`` (``host:port``)."""
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
        return cls(store, address)

    # --- the coordinator ------------------------------------------------------------------------------------------

    @property
    def members(self) -> list[int]:
        """The newest generation's members, as the coordinator published them."""
        return list(self._members)

    def publish(self, members: list[int]) -> int:
        """A new generation of ``members`` (replica indices; rank = position); returns its number."""
        generation = self.latest() + 1
        self.store.set(f"members/{generation}", ",".join(map(str, members)))
        self.store.add("generation", 1)  # after the list: whoever sees the number finds its members
        self._members = list(members)
        return generation

    # --- a member ---------------------------------------------------------------------------------------------------

    def latest(self) -> int:
        """The newest generation's number (0: none published yet)."""
        return self.store.add("generation", 0)

    def members_of(self, generation: int) -> list[int]:
        text = self.store.get(f"members/{generation}").decode()
        return [int(i) for i in text.split(",")] if text else []

    def form(self, generation: int, index: int, device: torch.device, timeout_s: float) -> None:
        """Leaves the default process group (if any) and forms ``generation``'s, as replica ``index`` (one of its
        members). Blocks until every member has come (at most ``timeout_s``, then raises); a collective of the new
        group then waits ``timeout_s`` at most for its peers."""
        members = self.members_of(generation)
        if dist.is_initialized():
            dist.destroy_process_group()  # works after a peer's death too: gloo's pairs are just closed
        dist.init_process_group(backend_for(device), store=dist.PrefixStore(f"g{generation}/", self.store),
                                rank=members.index(index), world_size=len(members),
                                timeout=timedelta(seconds=timeout_s))  # fmt: skip
