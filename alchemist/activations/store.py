"""The activation store: recorded prompts, keyed by response id, in three tiers with a byte budget each.

Tiers: ``device`` (where the record was computed: GPU memory on CUDA, process memory on CPU), ``host`` (pinned CPU
memory on CUDA; process memory on CPU) and ``disk`` (one file per record under ``disk_dir``, memory-mapped for reads,
checked on every read: ``disk.py``). A record lives in one tier. A put makes room in the device tier by moving the
lowest-priority records down (device -> host at once: ``placement.py``; a tier above disk more than
``WRITEBACK_FRACTION`` full writes its lowest-priority records to disk on a background thread, readable where they
are until their file is complete: ``disk_writer.py``) and, below that, by evicting them. Priority
(``evict_priority``): "requested" ranks records whose request asked to be recorded above the others, then least
recently used first; "lru" is recency alone. Records older than ``ttl_s`` are dropped from every tier. A record being
trained on is pinned: never moved, never evicted. A budget is never exceeded, not even while a disk write is in
flight: the file's bytes are reserved before it is written, the source's freed after. With host and disk budgets of
0 this is a plain in-memory LRU store.

Records are read one layer at a time (``get_layer``) so the trainer's layer walk can fetch and drop them in backward
order. A disk file found truncated or altered raises ``RecordCorruptError`` (a ``RecordUnavailable``, a ``KeyError``)
and the record is dropped: the caller recomputes. Thread-safe: the engine thread puts, the trainer's threads read.

    store = ActivationStore(2 << 30, host_budget_bytes=4 << 30, disk_budget_bytes=16 << 30, disk_dir="records")
    store.put(record); store.pin(rid); layer = store.get_layer(rid, 29); store.release(rid)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from alchemist.activations import disk
from alchemist.activations.disk_writer import DiskWriter
from alchemist.activations.placement import Entry, Placement, StoreStats
from alchemist.activations.record import Record
from alchemist.activations.tiers import TierCopies
from alchemist.config import RecordConfig


class RecordUnavailable(KeyError):
    """The record is not (or no longer) in the store: recompute."""


class RecordCorruptError(RecordUnavailable):
    """The record's disk file was truncated or altered; the record was dropped (``stats.corrupt``)."""


class ActivationStore:
    def __init__(
        self,
        budget_bytes: int,
        ttl_s: float = 3600.0,
        *,
        host_budget_bytes: int = 0,
        disk_budget_bytes: int = 0,
        disk_dir: str | Path | None = None,
        evict_priority: str = "requested",
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``budget_bytes`` is the device tier's. ``disk_dir`` (None: a temporary directory) is cleaned of files of
        an earlier run here. ``clock`` is compared with ``Record.created_s`` for the TTL."""
        # RecordConfig's checks are the store's (one set of bounds, however the store is built).
        RecordConfig(store_budget_bytes=budget_bytes, host_budget_bytes=host_budget_bytes,
                     disk_budget_bytes=disk_budget_bytes, evict_priority=evict_priority, ttl_s=ttl_s)  # fmt: skip
        self.budgets = {"device": budget_bytes, "host": host_budget_bytes, "disk": disk_budget_bytes}
        self.stats = StoreStats()
        self._clock = clock
        self._lock = threading.Lock()  # over all of the below; the disk writer takes it too
        self._copies = TierCopies()
        self._placement = Placement(self.budgets, evict_priority, ttl_s, self.stats, self._copies)
        self._writer = DiskWriter(self._placement, self._lock, self._copies, disk_dir)
        self.disk_dir = self._writer.disk_dir

    @classmethod
    def from_config(cls, config: RecordConfig) -> ActivationStore:
        return cls(
            config.store_budget_bytes,
            config.ttl_s,
            host_budget_bytes=config.host_budget_bytes,
            disk_budget_bytes=config.disk_budget_bytes,
            disk_dir=config.disk_dir,
            evict_priority=config.evict_priority,
        )

    @property
    def budget_bytes(self) -> int:
        return self.budgets["device"]

    @property
    def ttl_s(self) -> float:
        return self._placement.ttl_s

    @property
    def evict_priority(self) -> str:
        return self._placement.evict_priority

    def put(self, record: Record) -> bool:
        """Stores the record in the device tier, moving down, then evicting, lower-priority records to make room.

        False (``stats.rejected``) if there is no room for it, or a record of that id is pinned."""
        with self._lock:
            self.stats.puts += 1
            old = self._placement.get(record.record_id)
            if old is not None and old.pins:
                self.stats.rejected += 1
                return False
            if old is not None:
                self._placement.drop(old)
            self._placement.expire(self._clock())
            device = next(iter(record.layers[0].values())).device if record.layers and record.layers[0] else None
            entry = Entry(record, len(record.layers), device or torch.device("cpu"), self._placement.key(record))
            if not self._placement.make_room("device", record.nbytes, entry.key):
                self.stats.rejected += 1
                return False
            entry.ready = self._copies.mark(entry.device)
            self._placement.add(entry)
            self._writer.write_back()
            return True

    def lookup(self, record_id: str) -> Record | None:
        """The record, counting a hit or a miss. Read its layers with ``get_layer``: a record on disk has meta
        tensors (shapes and dtypes, no values) for layers."""
        with self._lock:
            self._placement.expire(self._clock())
            entry = self._placement.get(record_id)
            if entry is None:
                self.stats.misses += 1
                return None
            self._placement.touch(entry)
            self.stats.hits += 1
            return entry.record

    def tier_of(self, record_id: str) -> str | None:
        """Where the record is read from now ("device", "host" or "disk"), None if it is not here."""
        with self._lock:
            entry = self._placement.get(record_id)
            return None if entry is None else entry.tier

    def get_layer(self, record_id: str, layer: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Layer ``layer`` of the record, {name: (num_tokens, width)} on the device it was recorded on; only the
        tensors ``names`` (default: all) are read.

        Device tier: the stored tensors; host: copies on CUDA, the stored tensors on CPU; disk: tensors read from
        the file and verified. RecordUnavailable if the record is not here; RecordCorruptError (the record is then
        dropped) if its file is damaged.
        """
        with self._lock:
            entry = self._placement.get(record_id)
            if entry is None:
                raise RecordUnavailable(f"record {record_id} is not in the store")
            if not 0 <= layer < entry.num_layers:
                raise IndexError(f"record {record_id} has {entry.num_layers} layers (asked for {layer})")
            tier, layers, path, ready = entry.tier, entry.record.layers, entry.path, entry.ready
        if tier != "disk":
            stored = layers[layer] if names is None else {name: layers[layer][name] for name in names}
            return self._copies.to_device(stored, entry.device, ready)
        assert path is not None
        try:
            tensors = disk.read_layer(path, layer, names)
        except (FileNotFoundError, disk.CorruptFileError) as e:
            with self._lock:
                if self._placement.get(record_id) is not entry:  # evicted while we read: its file went with it
                    raise RecordUnavailable(f"record {record_id} is no longer in the store") from e
                self.stats.corrupt += 1
                self._placement.drop(entry)
            raise RecordCorruptError(f"record {record_id} was dropped: {e}") from e
        with self._lock:
            self.stats.disk_reads += 1
        return self._copies.to_device(tensors, entry.device, None)

    def pin(self, record_id: str) -> bool:
        """Keeps the record from moving or eviction until ``release``; False if it is not here."""
        with self._lock:
            entry = self._placement.get(record_id)
            if entry is None:
                return False
            entry.pins += 1
            return True

    def release(self, record_id: str) -> None:
        with self._lock:
            if self._placement.unpin(record_id):
                self._writer.write_back()  # it may be the one to write

    def evict(self, record_id: str) -> bool:
        with self._lock:
            entry = self._placement.get(record_id)
            if entry is None or entry.pins:
                return False
            self._placement.drop(entry)
            return True

    def __contains__(self, record_id: str) -> bool:
        with self._lock:
            return record_id in self._placement.entries

    def flush(self) -> None:
        """Waits until the disk writes queued so far (and those they queue) have ended."""
        self._writer.flush()

    def close(self) -> None:
        """Drops every record (pinned ones too) and its file, and stops the disk writer."""
        with self._lock:
            for entry in list(self._placement.entries.values()):
                self._placement.drop(entry)
            writer = self._writer.detach()
        self._writer.stop(writer)
