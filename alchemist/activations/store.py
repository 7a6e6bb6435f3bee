"""The activation store: recorded prompts, keyed by response id, under a byte budget, TTL and LRU eviction.

This is the in-memory tier; the tiered store (host, disk) fills the same interface. Records are read one layer
at a time (``get_layer``) so the trainer's layer walk can fetch and drop them in backward order; a record being
trained on is pinned and never evicted. Thread-safe: the engine thread puts, the trainer thread reads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from alchemist.activations.record import Record


@dataclass
class StoreStats:
    bytes_held: int = 0
    records: int = 0
    puts: int = 0
    rejected: int = 0  # larger than the whole budget, or no room because everything else is pinned
    evictions: int = 0
    expirations: int = 0
    hits: int = 0
    misses: int = 0


class ActivationStore:
    def __init__(self, budget_bytes: int, ttl_s: float = 3600.0) -> None:
        if budget_bytes < 0:
            raise ValueError(f"activation store budget_bytes must be >= 0 (got {budget_bytes})")
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._records: OrderedDict[str, Record] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stats = StoreStats()

    def put(self, record: Record) -> bool:
        """Stores the record, evicting expired then least recently used unpinned records to make room."""
        size = record.nbytes
        with self._lock:
            self.stats.puts += 1
            self._drop(record.record_id)
            self._expire(time.time())
            while self.stats.bytes_held + size > self.budget_bytes and self._evict_lru():
                pass
            if self.stats.bytes_held + size > self.budget_bytes:
                self.stats.rejected += 1
                return False
            self._records[record.record_id] = record
            self.stats.bytes_held += size
            self.stats.records = len(self._records)
            return True

    def lookup(self, record_id: str) -> Record | None:
        """The record (its metadata; layers via ``get_layer``), counting a hit or a miss."""
        with self._lock:
            self._expire(time.time())
            record = self._records.get(record_id)
            if record is None:
                self.stats.misses += 1
                return None
            self._records.move_to_end(record_id)
            self.stats.hits += 1
            return record

    def get_layer(self, record_id: str, layer: int) -> dict[str, torch.Tensor]:
        with self._lock:
            record = self._records.get(record_id)
        if record is None:
            raise KeyError(f"record {record_id} is not in the store")
        return record.layers[layer]

    def pin(self, record_id: str) -> bool:
        """Keeps the record from eviction until ``release``; False if it is not here."""
        with self._lock:
            if record_id not in self._records:
                return False
            self._pins[record_id] = self._pins.get(record_id, 0) + 1
            return True

    def release(self, record_id: str) -> None:
        with self._lock:
            count = self._pins.get(record_id, 0) - 1
            if count > 0:
                self._pins[record_id] = count
            else:
                self._pins.pop(record_id, None)

    def evict(self, record_id: str) -> bool:
        with self._lock:
            if record_id in self._pins:
                return False
            return self._drop(record_id)

    def __contains__(self, record_id: str) -> bool:
        with self._lock:
            return record_id in self._records

    # --- under the lock ---------------------------------------------------------------------------------------

    def _drop(self, record_id: str) -> bool:
        record = self._records.pop(record_id, None)
        if record is None:
            return False
        self.stats.bytes_held -= record.nbytes
        self.stats.records = len(self._records)
        return True

    def _evict_lru(self) -> bool:
        for record_id in self._records:
            if record_id not in self._pins:
                self._drop(record_id)
                self.stats.evictions += 1
                return True
        return False

    def _expire(self, now: float) -> None:
        expired = [
            rid for rid, r in self._records.items() if now - r.created_s > self.ttl_s and rid not in self._pins
        ]
        for rid in expired:
            self._drop(rid)
            self.stats.expirations += 1
