"""The activation store: recorded prompts, keyed by response id, in three tiers with a byte budget each.

Tiers: ``device`` (where the record was computed: GPU memory on CUDA, process memory on CPU), ``host`` (pinned CPU
memory on CUDA; process memory on CPU) and ``disk`` (one file per record under ``disk_dir``, memory-mapped for reads,
checked on every read: ``disk.py``). A record lives in one tier. A put makes room in the device tier by moving the
lowest-priority records down (device -> host at once; a tier above disk more than ``WRITEBACK_FRACTION`` full writes
its lowest-priority records to disk on a background thread, readable where they are until their file is complete)
and, below that, by evicting them. Priority (``evict_priority``): "requested" ranks records whose request asked to be
recorded above the others, then least recently used first; "lru" is recency alone. Records older than ``ttl_s`` are
dropped from every tier. A record being trained on is pinned: never moved, never evicted. A budget is never exceeded,
not even while a disk write is in flight: the file's bytes are reserved before it is written, the source's freed
after. With host and disk budgets of 0 this is a plain in-memory LRU store.

Records are read one layer at a time (``get_layer``) so the trainer's layer walk can fetch and drop them in backward
order. A disk file found truncated or altered raises ``RecordCorruptError`` (a ``RecordUnavailable``, a ``KeyError``)
and the record is dropped: the caller recomputes. Thread-safe: the engine thread puts, the trainer's threads read.

    store = ActivationStore(2 << 30, host_budget_bytes=4 << 30, disk_budget_bytes=16 << 30, disk_dir="records")
    store.put(record); store.pin(rid); layer = store.get_layer(rid, 29); store.release(rid)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from alchemist.activations import disk
from alchemist.activations.record import Record
from alchemist.activations.tiers import TierCopies
from alchemist.config import RecordConfig

TIERS = ("device", "host", "disk")
# A tier above disk starts writing records to disk once it is this full, so that a burst of puts finds room in it
# without waiting for the disk (a put that still finds it full evicts from it).
WRITEBACK_FRACTION = 0.75

log = logging.getLogger(__name__)


class RecordUnavailable(KeyError):
    """The record is not (or no longer) in the store: recompute."""


class RecordCorruptError(RecordUnavailable):
    """The record's disk file was truncated or altered; the record was dropped (``stats.corrupt``)."""


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
class _Entry:
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


def _shapes_only(layers: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Meta tensors: the shapes and dtypes of a record on disk (its ``nbytes`` and ``dtype`` hold), no values."""
    return [{n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in layer.items()} for layer in layers]


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
        self.ttl_s = ttl_s
        self.evict_priority = evict_priority
        self._clock = clock
        self._records: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        # Pins of records dropped while pinned (damaged files): their holders' releases consume these first, so a
        # later record under the same id never loses a pin of its own.
        self._orphan_pins: dict[str, int] = {}
        self._lock = threading.Lock()
        self._ticks = itertools.count()  # recency
        self._file_ids = itertools.count()
        self._copies = TierCopies()
        self._writes: queue.Queue[_Entry | None] = queue.Queue()  # None: stop
        self._writer: threading.Thread | None = None
        self._leaving_bytes = 0  # bytes of the records being written, in the tier they are leaving
        self.disk_dir: Path | None = None
        if disk_budget_bytes:
            if disk_dir is None:
                self.disk_dir = Path(tempfile.mkdtemp(prefix="alchemist-records-"))
                weakref.finalize(self, shutil.rmtree, self.disk_dir, ignore_errors=True)
            else:
                self.disk_dir = Path(disk_dir)
                self.disk_dir.mkdir(parents=True, exist_ok=True)
                disk.remove_stale(self.disk_dir)
        self.stats = StoreStats()

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

    def put(self, record: Record) -> bool:
        """Stores the record in the device tier, moving down, then evicting, lower-priority records to make room.

        False (``stats.rejected``) if there is no room for it, or a record of that id is pinned."""
        with self._lock:
            self.stats.puts += 1
            old = self._records.get(record.record_id)
            if old is not None and old.pins:
                self.stats.rejected += 1
                return False
            if old is not None:
                self._drop(old)
            self._expire(self._clock())
            device = next(iter(record.layers[0].values())).device if record.layers and record.layers[0] else None
            entry = _Entry(record, len(record.layers), device or torch.device("cpu"), self._key(record))
            if not self._make_room("device", record.nbytes, entry.key):
                self.stats.rejected += 1
                return False
            entry.ready = self._copies.mark(entry.device)
            self._records[record.record_id] = entry
            self._place(entry, "device", record.nbytes)
            self._write_back()
            return True

    def lookup(self, record_id: str) -> Record | None:
        """The record, counting a hit or a miss. Read its layers with ``get_layer``: a record on disk has meta
        tensors (shapes and dtypes, no values) for layers."""
        with self._lock:
            self._expire(self._clock())
            entry = self._records.get(record_id)
            if entry is None:
                self.stats.misses += 1
                return None
            self._records.move_to_end(record_id)
            entry.key = self._key(entry.record)
            self.stats.hits += 1
            return entry.record

    def tier_of(self, record_id: str) -> str | None:
        """Where the record is read from now ("device", "host" or "disk"), None if it is not here."""
        with self._lock:
            entry = self._records.get(record_id)
            return None if entry is None else entry.tier

    def get_layer(self, record_id: str, layer: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Layer ``layer`` of the record, {name: (num_tokens, width)} on the device it was recorded on; only the
        tensors ``names`` (default: all) are read.

        Device tier: the stored tensors; host: copies on CUDA, the stored tensors on CPU; disk: tensors read from
        the file and verified. RecordUnavailable if the record is not here; RecordCorruptError (the record is then
        dropped) if its file is damaged.
        """
        with self._lock:
            entry = self._records.get(record_id)
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
                if self._records.get(record_id) is not entry:  # evicted while we read: its file went with it
                    raise RecordUnavailable(f"record {record_id} is no longer in the store") from e
                self.stats.corrupt += 1
                self._drop(entry)
            raise RecordCorruptError(f"record {record_id} was dropped: {e}") from e
        with self._lock:
            self.stats.disk_reads += 1
        return self._copies.to_device(tensors, entry.device, None)

    def pin(self, record_id: str) -> bool:
        """Keeps the record from moving or eviction until ``release``; False if it is not here."""
        with self._lock:
            entry = self._records.get(record_id)
            if entry is None:
                return False
            entry.pins += 1
            return True

    def release(self, record_id: str) -> None:
        with self._lock:
            if orphans := self._orphan_pins.pop(record_id, 0):
                if orphans > 1:
                    self._orphan_pins[record_id] = orphans - 1
                return
            entry = self._records.get(record_id)
            if entry is not None and entry.pins:
                entry.pins -= 1
                self._write_back()  # it may be the one to write

    def evict(self, record_id: str) -> bool:
        with self._lock:
            entry = self._records.get(record_id)
            if entry is None or entry.pins:
                return False
            self._drop(entry)
            return True

    def __contains__(self, record_id: str) -> bool:
        with self._lock:
            return record_id in self._records

    def flush(self) -> None:
        """Waits until the disk writes queued so far (and those they queue) have ended."""
        self._writes.join()

    def close(self) -> None:
        """Drops every record (pinned ones too) and its file, and stops the disk writer."""
        with self._lock:
            for entry in list(self._records.values()):
                self._drop(entry)
            writer, self._writer = self._writer, None
        if writer is not None:
            self._writes.put(None)  # after the queued writes, which find their records dropped
            writer.join()

    # --- under the lock ---------------------------------------------------------------------------------------

    def _key(self, record: Record) -> tuple[int, int]:
        return (int(record.requested and self.evict_priority == "requested"), next(self._ticks))

    def _charge(self, tier: str, nbytes: int) -> None:
        s = self.stats
        s.tier_bytes[tier] += nbytes
        s.max_tier_bytes[tier] = max(s.max_tier_bytes[tier], s.tier_bytes[tier])
        assert s.tier_bytes[tier] <= self.budgets[tier], f"{tier} tier over budget"

    def _place(self, entry: _Entry, tier: str, nbytes: int) -> None:
        self._charge(tier, nbytes)
        entry.tier, entry.nbytes = tier, nbytes
        self.stats.tier_records[tier] += 1
        self.stats.bytes_held += nbytes
        self.stats.records = len(self._records)

    def _unplace(self, entry: _Entry, free: bool = True) -> None:
        if free:
            self.stats.tier_bytes[entry.tier] -= entry.nbytes
        self.stats.tier_records[entry.tier] -= 1
        self.stats.bytes_held -= entry.nbytes
        self.stats.records = len(self._records)

    def _drop(self, entry: _Entry) -> None:
        record_id = entry.record.record_id
        del self._records[record_id]
        if entry.pins:
            self._orphan_pins[record_id] = self._orphan_pins.get(record_id, 0) + entry.pins
        if entry.writing:  # the writer still reads its tensors: their bytes stay counted until it is done
            entry.dropped = True
            self._unplace(entry, free=False)
            return
        self._unplace(entry)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    def _expire(self, now: float) -> None:
        for entry in [e for e in self._records.values() if now - e.record.created_s > self.ttl_s and not e.pins]:
            self._drop(entry)
            self.stats.expirations += 1

    def _victim(self, tier: str, to_disk: bool = False) -> _Entry | None:
        """The lowest-priority record of ``tier`` that may move (``to_disk``: and be written)."""
        candidates = (
            e
            for e in self._records.values()
            if e.tier == tier and not e.pins and not e.writing and not (to_disk and e.unwritable)
        )
        return min(candidates, key=lambda e: e.key, default=None)

    def _make_room(self, tier: str, nbytes: int, key: tuple[int, int]) -> bool:
        """Frees room for ``nbytes`` in ``tier`` for a record of priority ``key``: its lowest-priority records move
        down a memory tier if there is room there for them, else are evicted if they rank below ``key``."""
        if nbytes > self.budgets[tier]:
            return False
        while self.stats.tier_bytes[tier] + nbytes > self.budgets[tier]:
            victim = self._victim(tier)
            if victim is None:
                return False
            if tier == "device" and self.budgets["host"] and self._make_room("host", victim.nbytes, victim.key):
                self._to_host(victim)
            elif victim.key < key:
                self._drop(victim)
                self.stats.evictions += 1
            else:
                return False
        return True

    def _to_host(self, entry: _Entry) -> None:
        layers, entry.ready = self._copies.to_host(entry.record.layers, entry.device, entry.ready)
        entry.record = dataclasses.replace(entry.record, layers=layers)
        self._unplace(entry)
        self._place(entry, "host", entry.nbytes)
        self.stats.demotions += 1

    def _write_back(self) -> None:
        """Queues disk writes of the lowest-priority records of the tier above disk while it is too full."""
        if not self.budgets["disk"]:
            return
        source = "host" if self.budgets["host"] else "device"
        while self.stats.tier_bytes[source] - self._leaving_bytes > WRITEBACK_FRACTION * self.budgets[source]:
            victim = self._victim(source, to_disk=True)
            if victim is None:
                return
            reserve = disk.file_bytes_bound(victim.record.layers)
            if not self._make_room("disk", reserve, victim.key):
                return
            self._charge("disk", reserve)
            victim.writing = reserve
            self._leaving_bytes += victim.nbytes
            self._writes.put(victim)
            if self._writer is None:
                # A daemon: exiting never waits for queued writes (their files are stale at the next start).
                self._writer = threading.Thread(target=self._write_loop, name="activation-disk-writer", daemon=True)
                self._writer.start()

    # --- the writer thread ------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            entry = self._writes.get()
            if entry is None:
                self._writes.task_done()
                return
            try:
                self._write(entry)
            except Exception:
                log.exception("activation store: writing record %s failed", entry.record.record_id)
            finally:
                self._writes.task_done()

    def _write(self, entry: _Entry) -> None:
        with self._lock:
            if entry.dropped or entry.pins:  # gone, or being trained on: it stays where it is
                self._end_write(entry, None, None)
                return
            assert self.disk_dir is not None
            path = self.disk_dir / f"{next(self._file_ids):012d}{disk.SUFFIX}"
            layers, ready = entry.record.layers, entry.ready
            if entry.tier == "device":  # no host tier: copy to host memory first (CUDA; CPU: the same tensors)
                layers, ready = self._copies.to_host(layers, entry.device, ready)
        size = None
        try:
            if ready is not None:
                ready.synchronize()  # this thread waits for the copy to host; no stream does
            size = disk.write_record(path, layers)
        except Exception as e:  # disk full, permissions, ...: the record stays where it is
            log.warning("activation store: cannot write %s: %s", path, e)
            with self._lock:
                self.stats.disk_write_errors += 1
        finally:
            with self._lock:
                self._end_write(entry, path, size)

    def _end_write(self, entry: _Entry, path: Path | None, size: int | None) -> None:
        """Moves the record to its file, or keeps it where it is (write failed, record dropped or pinned)."""
        reserved, entry.writing = entry.writing, 0
        self.stats.tier_bytes["disk"] -= reserved
        self._leaving_bytes -= entry.nbytes
        if size is None or size > reserved or entry.dropped or entry.pins:
            if path is not None:
                path.unlink(missing_ok=True)
            if entry.dropped:
                self.stats.tier_bytes[entry.tier] -= entry.nbytes
            elif path is not None and not entry.pins:  # failed: stays where it is, for good
                entry.unwritable = True
        else:
            self._unplace(entry)
            entry.record = dataclasses.replace(entry.record, layers=_shapes_only(entry.record.layers))
            entry.path, entry.ready = path, None
            self._place(entry, "disk", size)
            self.stats.disk_writes += 1
            self.stats.demotions += 1
        self._write_back()
