"""The feedback backlog over time, as a benchmark watches a server: `alchemist bench online`'s ``backlog`` rows.

    sampler = BacklogSampler(lambda: scrape(url), interval_s=5.0).start()
    ...                                   # the load
    sampler.phase = "drain"
    samples = sampler.stop()              # [{"t_s", "phase", "correction", "thumbs_up", ..., "oldest_s"}, ...]

Each sample reads the server's /metrics (``alchemist:feedback_backlog{kind=...}``: acknowledged feedback neither
trained nor skipped, by class, and the age of each class's oldest) from a thread of its own, so the load's event
loop never waits for it; one scrape every few seconds costs the server a SQLite count.

Its other face, how long each correction waited to be served: ``TrainedThrough`` polls the feedback log position the
newest adapter version has trained through and the entries the kept promoted versions trained (``bench online``'s
``trained``: an entry a batch carried over settles after newer ones) from a thread of its own, and
``served_after(seq, at)`` says how long after ``at`` (a ``time.perf_counter()``, e.g. the correction's
acknowledgement) a version that trained entry ``seq`` was first seen (None: not by ``stop()``); the error is at most
one interval.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

BACKLOG = "alchemist:feedback_backlog"
CLASSES = ("correction", "thumbs_up", "thumbs_down", "preference")


class BacklogSampler:
    def __init__(self, read_metrics: Callable[[], dict[str, float]], interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the backlog's sampling interval must be > 0 (got {interval_s!r})")
        self.read_metrics = read_metrics
        self.interval_s = interval_s
        self.phase = "load"  # the label of the samples taken from now on
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backlog-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> BacklogSampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        """Stops sampling after one last sample; returns them all, oldest first."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self) -> None:
        try:
            metrics = self.read_metrics()
        except Exception as e:  # a missed sample is a gap in the series, not a failed benchmark
            self.samples.append({"t_s": self._elapsed(), "phase": self.phase, "error": f"{type(e).__name__}: {e}"})
            return
        counts = {c: int(metrics.get(f'{BACKLOG}{{kind="{c}"}}', 0)) for c in CLASSES}
        oldest = max((metrics.get(f'{BACKLOG}_oldest_seconds{{kind="{c}"}}', 0.0) for c in CLASSES), default=0.0)
        self.samples.append({"t_s": self._elapsed(), "phase": self.phase, **counts, "queued": sum(counts.values()),
                             "oldest_s": round(oldest, 1)})  # fmt: skip

    def _elapsed(self) -> float:
        return round(time.perf_counter() - self._t0, 1)


class TrainedThrough:
    def __init__(self, read: Callable[[], tuple[int, set[int]]], interval_s: float) -> None:
        """``read``: the position trained through and the seqs trained (by the versions still listed)."""
        if not interval_s > 0:
            raise ValueError(f"the polling interval must be > 0 (got {interval_s!r})")
        self.read = read
        self.interval_s = interval_s
        self.seen: list[tuple[float, int]] = []  # (perf_counter, position) where the position grew
        self.first_seen: dict[int, float] = {}  # seq -> perf_counter when a version that trained it was first seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trained-through", daemon=True)

    def start(self) -> TrainedThrough:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def served_after(self, seq: int, at: float) -> float | None:
        times = [t for t, position in self.seen if position >= seq][:1] + [self.first_seen.get(seq, math.inf)]
        return max(0.0, min(times) - at) if min(times) < math.inf else None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval_s)

    def _poll(self) -> None:
        try:
            position, seqs = self.read()
        except Exception:  # a missed poll widens one correction's error, it does not fail the benchmark
            return
        now = time.perf_counter()
        if not self.seen or position > self.seen[-1][1]:
            self.seen.append((now, position))
        for seq in seqs:
            self.first_seen.setdefault(seq, now)
