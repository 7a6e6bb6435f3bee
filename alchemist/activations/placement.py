"""Where the activation store's records live: the tiers' accounting, priorities and room-making.

A record lives in one tier (``TIERS``) and is counted against that tier's byte budget. Room is made in a tier by
moving its lowest-priority unpinned records down a memory tier (device -> host) where there is room for them, else
by evicting those that rank below the newcomer. Priority (``evict_priority``): "requested" ranks records whose
request asked to be recorded above the others, then least recently used first; "lru" is recency alone.

``Placement`` holds no lock: the store calls it under its own (``store.py``); the disk writer (``disk_writer.py``)
moves records to the disk tier through it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from alchemist.activations.record import Record
from alchemist.activations.tiers import TierCopies

TIERS = ("device", "host", "disk")


def _per_tier() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


@dataclass
class StoreStats:
    bytes_held: int = 0  # bytes of the records held, each counted once, in the tier it is read from
    records: int = 0
    puts: int = 0
    rejected: int = 0  # larger than the device budget, or no room without evicting higher priorities or pins
    evictions: int = 0  # dropped to make room
    expirations: int = 0
    hits: int = 0
    misses: int = 0
    demotions: int = 0  # moves to a lower tier (disk writes included)
    disk_writes: int = 0  # record files completed
    disk_write_errors: int = 0  # writes that failed (the record stayed where it was)
    disk_reads: int = 0  # layers read from disk and verified
    corrupt: int = 0  # records dropped because their file was truncated or altered
    tier_bytes: dict[str, int] = field(default_factory=_per_tier)  # counted against each budget (reservations too)
    tier_records: dict[str, int] = field(default_factory=_per_tier)
    max_tier_bytes: dict[str, int] = field(default_factory=_per_tier)  # high-water marks of tier_bytes


@dataclass(eq=False)
class Entry:
    record: Record  # lookup's answer; its layers are the tensors held in device or host, meta tensors on disk
    num_layers: int
    device: torch.device  # where get_layer returns the layers
    key: tuple[int, int]  # priority: the lowest is moved down or evicted first
    tier: str = "device"
    nbytes: int = 0  # counted in tier_bytes[tier]
    ready: torch.cuda.Event | None = None  # CUDA: the layers' copies are complete once it has passed
    path: Path | None = None  # the record's file, on disk
    pins: int = 0
    writing: int = 0  # disk bytes reserved by a write in flight (0: none)
    dropped: bool = False  # dropped while being written: its bytes are freed when the write ends
    unwritable: bool = False  # its disk write failed: not tried again


class Placement:
    def __init__(
        self,
        budgets: dict[str, int],
        evict_priority: str,
        ttl_s: float,
        stats: StoreStats,
        copies: TierCopies,
    ) -> None:
        self.budgets = budgets
        self.evict_priority = evict_priority
        self.ttl_s = ttl_s
        self.stats = stats
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        # Pins of records dropped while pinned (damaged files): their holders' releases consume these first, so a
        # later record under the same id never loses a pin of its own.
        self.orphan_pins: dict[str, int] = {}
        self._ticks = itertools.count()  # recency
        self._copies = copies

    def get(self, record_id: str) -> Entry | None:
        return self.entries.get(record_id)

    def add(self, entry: Entry) -> None:
        """Places a new record in the device tier, which has room for it (``make_room``)."""
        self.entries[entry.record.record_id] = entry
        self.place(entry, "device", entry.record.nbytes)

    def touch(self, entry: Entry) -> None:
        """The record was used: it becomes the most recent."""
        self.entries.move_to_end(entry.record.record_id)
        entry.key = self.key(entry.record)

    def key(self, record: Record) -> tuple[int, int]:
        return (int(record.requested and self.evict_priority == "requested"), next(self._ticks))

    def charge(self, tier: str, nbytes: int) -> None:
        s = self.stats
        s.tier_bytes[tier] += nbytes
        s.max_tier_bytes[tier] = max(s.max_tier_bytes[tier], s.tier_bytes[tier])
        assert s.tier_bytes[tier] <= self.budgets[tier], f"{tier} tier over budget"

    def place(self, entry: Entry, tier: str, nbytes: int) -> None:
        self.charge(tier, nbytes)
        entry.tier, entry.nbytes = tier, nbytes
        self.stats.tier_records[tier] += 1
        self.stats.bytes_held += nbytes
        self.stats.records = len(self.entries)

    def unplace(self, entry: Entry, free: bool = True) -> None:
        if free:
            self.stats.tier_bytes[entry.tier] -= entry.nbytes
        self.stats.tier_records[entry.tier] -= 1
        self.stats.bytes_held -= entry.nbytes
        self.stats.records = len(self.entries)

    def drop(self, entry: Entry) -> None:
        record_id = entry.record.record_id
        del self.entries[record_id]
        if entry.pins:
            self.orphan_pins[record_id] = self.orphan_pins.get(record_id, 0) + entry.pins
        if entry.writing:  # the writer still reads its tensors: their bytes stay counted until it is done
            entry.dropped = True
            self.unplace(entry, free=False)
            return
        self.unplace(entry)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    def expire(self, now: float) -> None:
        for entry in [e for e in self.entries.values() if now - e.record.created_s > self.ttl_s and not e.pins]:
            self.drop(entry)
            self.stats.expirations += 1

    def unpin(self, record_id: str) -> bool:
        """Releases one pin; True if it was the record's own (not one of a record dropped while pinned)."""
        if orphans := self.orphan_pins.pop(record_id, 0):
            if orphans > 1:
                self.orphan_pins[record_id] = orphans - 1
            return False
        entry = self.entries.get(record_id)
        if entry is None or not entry.pins:
            return False
        entry.pins -= 1
        return True

    def victim(self, tier: str, to_disk: bool = False) -> Entry | None:
        """The lowest-priority record of ``tier`` that may move (``to_disk``: and be written)."""
        candidates = (
            e
            for e in self.entries.values()
            if e.tier == tier and not e.pins and not e.writing and not (to_disk and e.unwritable)
        )
        return min(candidates, key=lambda e: e.key, default=None)

    def make_room(self, tier: str, nbytes: int, key: tuple[int, int]) -> bool:
        """Frees room for ``nbytes`` in ``tier`` for a record of priority ``key``: its lowest-priority records move
        down a memory tier if there is room there for them, else are evicted if they rank below ``key``."""
        if nbytes > self.budgets[tier]:
            return False
        while self.stats.tier_bytes[tier] + nbytes > self.budgets[tier]:
            victim = self.victim(tier)
            if victim is None:
                return False
            if tier == "device" and self.budgets["host"] and self.make_room("host", victim.nbytes, victim.key):
                self._to_host(victim)
            elif victim.key < key:
                self.drop(victim)
                self.stats.evictions += 1
            else:
                return False
        return True

    def _to_host(self, entry: Entry) -> None:
        layers, entry.ready = self._copies.to_host(entry.record.layers, entry.device, entry.ready)
        entry.record = dataclasses.replace(entry.record, layers=layers)
        self.unplace(entry)
        self.place(entry, "host", entry.nbytes)
        self.stats.demotions += 1
