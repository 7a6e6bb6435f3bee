"""The dashboard's time series: the server's own numbers sampled once a second into fixed-size ring buffers.

    GET /v1/dashboard/series[?since=T] -> {"object": "dashboard.series", "interval_s": 1.0, "capacity": 600,
                                          "t": [unix s, ...], "series": {"training_loss": [...], ...}}

Nothing is counted here: each sample reads what /metrics reads (``LLMEngine.stats()``, the online trainer's
``TrainingStats``, the feedback log's queued entries) and ``ServerMetrics.recent``, the latencies its ``observe`` keeps.
Counters become rates (per second, between two samples); ratios are the trainer's totals so far, as /metrics shows
them. A value that does not exist yet (no training step, no request finished in the window) is ``null``. The sampler
is a thread of its own: it does no torch work, and the log's read must not stall the event loop.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from alchemist.activations.placement import TIERS
from alchemist.feedback.log import FeedbackLog
from alchemist.server.metrics import ServerMetrics

SERIES = (
    "training_loss",  # of the last optimizer step
    "training_samples_per_s",  # feedback sample passes trained per second
    "training_tokens_per_s",  # their response tokens per second
    "feedback_backlog",  # feedback entries queued (neither trained nor skipped yet)
    "replay_hit_rate",  # share of sample passes replayed from a record, so far
    "replay_staleness",  # mean adapter versions between a replayed record and the adapter it trained, so far
    "adapter_version",  # the version the engine serves
    "ttft_p50_s",  # over the requests finished in the last WINDOW_S
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "requests_running",
    "requests_waiting",
    "generation_tokens_per_s",
    "kv_cache_usage",
    *(f"activation_bytes_{tier}" for tier in TIERS),
)
WINDOW_S = 10.0  # latency percentiles are over the requests that finished this recently
logger = logging.getLogger(__name__)


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in [0, 100]); None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class SeriesRecorder:
    def __init__(
        self,
        metrics: ServerMetrics,
        log: FeedbackLog | None,
        read_version: Callable[[], int],
        capacity: int = 600,
        interval_s: float = 1.0,
    ):
        self.metrics = metrics
        self.log = log
        self.read_version = read_version
        self.capacity = capacity
        self.interval_s = interval_s
        self.times: deque[float] = deque(maxlen=capacity)
        self.values: dict[str, deque[float | None]] = {name: deque(maxlen=capacity) for name in SERIES}
        self._lock = threading.Lock()
        self._last: tuple[float, dict[str, float]] | None = None  # (monotonic time, counters) of the last sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- sampling -------------------------------------------------------------------------------------------------

    def sample(self) -> None:
        """Appends one point of every series (the rates: since the previous call)."""
        now = time.monotonic()
        stats = self.metrics.read_stats()
        trainer = self.metrics.trainer
        counters = {"generation_tokens": float(stats.num_generation_tokens)}
        point: dict[str, Any] = dict.fromkeys(SERIES)
        if trainer is not None:
            s = trainer.stats
            counters |= {"samples": float(s.samples), "tokens": float(s.response_tokens)}
            passes, replays = s.replayed + s.recomputed, s.replayed + s.anchor_replayed
            point["training_loss"] = s.last_loss
            point["replay_hit_rate"] = s.replayed / passes if passes else None
            point["replay_staleness"] = s.staleness_sum / replays if replays else None
        if self.log is not None:  # the partial index of queued entries makes this cheap
            point["feedback_backlog"] = len(self.log.queued_seqs())
        point["adapter_version"] = self.read_version()
        if self._last is not None:
            then, before = self._last
            dt = max(now - then, 1e-6)
            rate = lambda name: (counters[name] - before[name]) / dt if name in before else None
            point["generation_tokens_per_s"] = rate("generation_tokens")
            if trainer is not None:
                point["training_samples_per_s"] = rate("samples")
                point["training_tokens_per_s"] = rate("tokens")
        ttfts, tpots = self.metrics.recent.since(now - WINDOW_S)
        point |= {"ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}
        point |= {"tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99)}
        point |= {"requests_running": stats.num_running, "requests_waiting": stats.num_waiting}
        point["kv_cache_usage"] = stats.kv_cache_usage
        for tier in TIERS:
            point[f"activation_bytes_{tier}"] = stats.activation_tier_bytes.get(tier, 0)
        with self._lock:
            t = round(time.time(), 3)  # strictly increasing, so that ?since= never drops a point
            self.times.append(max(t, round(self.times[-1] + 0.001, 3)) if self.times else t)
            for name in SERIES:
                self.values[name].append(_compact(point[name]))
        self._last = (now, counters)

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """The points after unix time ``since`` (all kept, without it)."""
        with self._lock:
            times = list(self.times)
            start = 0 if since is None else next((i for i, t in enumerate(times) if t > since), len(times))
            series = {name: list(values)[start:] for name, values in self.values.items()}
        return {
            "object": "dashboard.series",
            "interval_s": self.interval_s,
            "capacity": self.capacity,
            "window_s": WINDOW_S,
            "t": times[start:],
            "series": series,
        }

    # --- the sampling thread --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dashboard-series", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a dashboard gap, never a dead server
                logger.exception("dashboard series: sample failed")


def _compact(value: Any) -> float | int | None:
    """Fewer digits in the JSON: 6 significant ones are more than a chart shows."""
    if value is None or isinstance(value, int):
        return value
    return float(f"{value:.6g}") if value == value else None  # NaN -> null
