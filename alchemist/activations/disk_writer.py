"""The activation store's disk writer: moves records from the tier above disk to files, on a background thread.

A tier above disk more than ``WRITEBACK_FRACTION`` full queues its lowest-priority records for writing; each stays
readable where it is until its file is complete, then moves to the disk tier. A budget is never exceeded, not even
while a write is in flight: the file's bytes (a bound, ``disk.file_bytes_bound``) are reserved before it is written,
trimmed to the file's size when it completes, and the source's freed then. A write that fails leaves the record
where it is, for good; a record dropped or pinned meanwhile is not moved.

``write_back`` runs under the store's lock (it queues); the writer thread takes that lock to pick a path and to end
a write, never while it writes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from alchemist.activations import disk
from alchemist.activations.placement import Entry, Placement
from alchemist.activations.tiers import TierCopies

# A tier above disk starts writing records to disk once it is this full, so that a burst of puts finds room in it
# without waiting for the disk (a put that still finds it full evicts from it).
WRITEBACK_FRACTION = 0.75

log = logging.getLogger(__name__)


def _shapes_only(layers: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Meta tensors: the shapes and dtypes of a record on disk (its ``nbytes`` and ``dtype`` hold), no values."""
    return [{n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in layer.items()} for layer in layers]


class DiskWriter:
    def __init__(
        self, placement: Placement, lock: threading.Lock, copies: TierCopies, disk_dir: str | Path | None
    ) -> None:
        """``disk_dir`` (None: a temporary directory, removed with this writer) is cleaned of files of an earlier
        run here; no directory at all without a disk budget."""
        self._placement = placement
        self._lock = lock  # the store's
        self._copies = copies
        self._file_ids = itertools.count()
        self._writes: queue.Queue[Entry | None] = queue.Queue()  # None: stop
        self._thread: threading.Thread | None = None
        self._leaving_bytes = 0  # bytes of the records being written, in the tier they are leaving
        self.disk_dir: Path | None = None
        if placement.budgets["disk"]:
            if disk_dir is None:
                self.disk_dir = Path(tempfile.mkdtemp(prefix="alchemist-records-"))
                weakref.finalize(self, shutil.rmtree, self.disk_dir, ignore_errors=True)
            else:
                self.disk_dir = Path(disk_dir)
                self.disk_dir.mkdir(parents=True, exist_ok=True)
                disk.remove_stale(self.disk_dir)

    def write_back(self) -> None:
        """Queues disk writes of the lowest-priority records of the tier above disk while it is too full. Under
        the store's lock."""
        placement, budgets = self._placement, self._placement.budgets
        if not budgets["disk"]:
            return
        source = "host" if budgets["host"] else "device"
        while placement.stats.tier_bytes[source] - self._leaving_bytes > WRITEBACK_FRACTION * budgets[source]:
            victim = placement.victim(source, to_disk=True)
            if victim is None:
                return
            reserve = disk.file_bytes_bound(victim.record.layers)
            if not placement.make_room("disk", reserve, victim.key):
                return
            placement.charge("disk", reserve)
            victim.writing = reserve
            self._leaving_bytes += victim.nbytes
            self._writes.put(victim)
            if self._thread is None:
                # A daemon: exiting never waits for queued writes (their files are stale at the next start).
                self._thread = threading.Thread(target=self._write_loop, name="activation-disk-writer", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        """Waits until the writes queued so far (and those they queue) have ended."""
        self._writes.join()

    def detach(self) -> threading.Thread | None:
        """The writer thread, forgotten (a later write starts a new one): ``stop`` it. Under the store's lock."""
        thread, self._thread = self._thread, None
        return thread

    def stop(self, thread: threading.Thread | None) -> None:
        if thread is not None:
            self._writes.put(None)  # after the queued writes, which find their records dropped
            thread.join()

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

    def _write(self, entry: Entry) -> None:
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
                self._placement.stats.disk_write_errors += 1
        finally:
            with self._lock:
                self._end_write(entry, path, size)

    def _end_write(self, entry: Entry, path: Path | None, size: int | None) -> None:
        """Moves the record to its file, or keeps it where it is (write failed, record dropped or pinned)."""
        placement, stats = self._placement, self._placement.stats
        reserved, entry.writing = entry.writing, 0
        stats.tier_bytes["disk"] -= reserved
        self._leaving_bytes -= entry.nbytes
        if size is None or size > reserved or entry.dropped or entry.pins:
            if path is not None:
                path.unlink(missing_ok=True)
            if entry.dropped:
                stats.tier_bytes[entry.tier] -= entry.nbytes
            elif path is not None and not entry.pins:  # failed: stays where it is, for good
                entry.unwritable = True
        else:
            placement.unplace(entry)
            entry.record = dataclasses.replace(entry.record, layers=_shapes_only(entry.record.layers))
            entry.path, entry.ready = path, None
            placement.place(entry, "disk", size)
            stats.disk_writes += 1
            stats.demotions += 1
        self.write_back()
