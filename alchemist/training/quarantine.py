"""Poisoning guard: feedback whose loss is not finite or far above the running level is not trained, but held
in quarantine, visible and releasable by an admin (GET /v1/quarantine, POST /v1/quarantine/release).

    guard = LossGuard(spike_factor=4.0, warmup=8)
    reasons = guard.check([1.9, float("nan"), 14.2])   # [None, "loss is nan", "loss 14.2 > 4 x the running level 2"]
    quarantine = Quarantine(data_dir / "quarantine.json")
    quarantine.hold(entry, reason, loss); quarantine.release([seq]); quarantine.trained([seq])

Why per sample and before the update: a correction that teaches garbage (or a NaN from a broken record) shows as
one sample's loss far above its peers', on the weights it is about to change; the batch is trained again without
it. The file is small JSON, replaced atomically; a held entry stays out of training across restarts, a released
one is trained (unchecked: an admin vouched for it) and forgotten once a checkpoint includes it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

from alchemist.feedback.log import FeedbackEntry


class LossGuard:
    """Flags sample losses that are NaN/inf, or above ``spike_factor`` x the running level (the mean of accepted
    losses, exponential with ``decay`` once it has seen enough) once ``warmup`` losses were seen. ``spike_factor``
    0 checks finiteness only."""

    def __init__(self, spike_factor: float, warmup: int = 8, decay: float = 0.9):
        self.spike_factor = spike_factor
        self.warmup = warmup
        self.decay = decay
        self.level: float | None = None
        self.seen = 0

    def check(self, losses: list[float]) -> list[str | None]:
        """A reason for each suspect loss, None for the others (which then update the running level)."""
        reasons = []
        for loss in losses:
            if not math.isfinite(loss):
                reasons.append(f"loss is {loss}")
            elif self.spike_factor and self.seen >= self.warmup and loss > self.spike_factor * self.level:
                reasons.append(f"loss {loss:.3g} > {self.spike_factor:g} x the running level {self.level:.3g}")
            else:
                reasons.append(None)
        for loss, reason in zip(losses, reasons, strict=True):
            if reason is None:  # the mean of the warm-up losses, then an exponential mean
                weight = max(1.0 - self.decay, 1.0 / (self.seen + 1))
                self.level = loss if self.level is None else (1 - weight) * self.level + weight * loss
                self.seen += 1
        return reasons


class Quarantine:
    """Held and released feedback entries by log seq, persisted in one JSON file. Thread-safe."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: dict[int, dict] = {}
        if self.path.exists():
            self._entries = {int(k): v for k, v in json.loads(self.path.read_text()).items()}

    def hold(self, entry: FeedbackEntry, reason: str, loss: float) -> None:
        with self._lock:
            self._entries[entry.seq] = {
                "seq": entry.seq,
                "response_id": entry.response_id,
                "reason": reason,
                "loss": loss if math.isfinite(loss) else str(loss),
                "held_at": time.time(),
                "released": False,
            }
            self._save()

    def is_held(self, seq: int) -> bool:
        with self._lock:
            entry = self._entries.get(seq)
            return entry is not None and not entry["released"]

    def release(self, seqs: list[int]) -> list[int]:
        """Marks held entries released (to be trained); returns those that were held."""
        with self._lock:
            released = [s for s in seqs if s in self._entries and not self._entries[s]["released"]]
            for seq in released:
                self._entries[seq]["released"] = True
            self._save()
            return released

    def released(self) -> list[int]:
        with self._lock:
            return sorted(s for s, e in self._entries.items() if e["released"])

    def trained(self, seqs: list[int]) -> None:
        """Released entries that a checkpoint now includes are forgotten."""
        with self._lock:
            done = [s for s in seqs if s in self._entries and self._entries[s]["released"]]
            for seq in done:
                del self._entries[seq]
            if done:
                self._save()

    def list(self) -> list[dict]:
        with self._lock:
            return [dict(e) for _, e in sorted(self._entries.items())]

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in self._entries.items()}))
        os.replace(tmp, self.path)
