"""Prometheus metrics for /metrics, named as vLLM names them with the prefix ``alchemist:`` instead of ``vllm:``.

Latency histograms and finish reasons are fed from the engine thread after each step (``observe``). Gauges
(running / waiting requests, KV-cache usage) and the engine's counters (prompt and generation tokens,
preemptions, prefix-cache queries and hits) are read from ``LLMEngine.stats()`` when Prometheus scrapes, so they
are current even while the engine sleeps. ``feedback_total`` counts the feedback log's new entries by kind
(``observe_feedback``, a log listener). Each app owns its CollectorRegistry, so a process (tests) can build several.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from alchemist.engine import EngineStats, RequestOutput
from alchemist.feedback.log import KINDS, FeedbackEntry, FeedbackLog

PREFIX = "alchemist:"
# vLLM's buckets, extended at the slow end for a CPU.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)
# Engine steps and training slices: what a decode waits for (a slice over 0.1 s stretches a token's gap severalfold).
STEP_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class _EngineStatsCollector(Collector):
    def __init__(self, read_stats: Callable[[], EngineStats]):
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        s = self.read_stats()
        gauges = (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 1 = full.", s.kv_cache_usage),
            ("activation_store_bytes", "Bytes of recorded prefill activations held for training.", s.activation_bytes),
            ("activation_store_records", "Recorded prompts held for training.", s.activation_records),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        tiers = GaugeMetricFamily(
            PREFIX + "activation_store_tier_bytes",
            "Bytes counted against each activation-store tier's budget (disk writes in flight included).",
            labels=["tier"],
        )
        for tier, value in s.activation_tier_bytes.items():
            tiers.add_metric([tier], value)
        yield tiers
        counters = (  # exposed with the suffix _total
            ("prompt_tokens", "Prompt tokens prefilled (recomputation not counted).", s.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens),
            ("num_preemptions", "Requests preempted (to be recomputed).", s.num_preemptions),
            ("recorded_prompts", "Prompt activation records completed and stored.", s.num_recorded),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.num_prefix_cache_queries),
            ("prefix_cache_hits", "Of those, tokens served from the prefix cache.", s.num_prefix_cache_hits),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class _TrainingCollector(Collector):
    """The online trainer's numbers (``alchemist.training.stats.TrainingStats``), read at scrape time."""

    def __init__(self, trainer) -> None:  # an OnlineTrainer
        self.trainer = trainer

    def collect(self) -> Iterator[Metric]:
        s = self.trainer.stats
        passes = s.replayed + s.recomputed
        yield CounterMetricFamily(PREFIX + "training_steps", "Optimizer steps of the online trainer.", value=s.steps)
        yield CounterMetricFamily(
            PREFIX + "training_tokens", "Response tokens trained on (once per epoch).", value=s.response_tokens
        )
        yield CounterMetricFamily(
            PREFIX + "training_seconds", "Time spent in training slices (between engine steps).", value=s.train_s
        )
        yield CounterMetricFamily(
            PREFIX + "training_allreduce_seconds", "Time of the gradients' all-reduce in data-parallel steps, launch "
            "to completion, the replicas having met (0 alone).", value=s.allreduce_s,
        )  # fmt: skip
        yield CounterMetricFamily(
            PREFIX + "training_sync_seconds", "Time of the data-parallel steps' meeting points (their sample count, "
            "then the vetoes before the gradients): waiting for the slower replica, mostly (0 alone).", value=s.sync_s,
        )  # fmt: skip
        samples = CounterMetricFamily(
            PREFIX + "training_samples", "Sample passes, by path: replayed or recomputed.", labels=["path"]
        )
        samples.add_metric(["replay"], s.replayed)
        samples.add_metric(["recompute"], s.recomputed)
        yield samples
        anchors = CounterMetricFamily(
            PREFIX + "training_anchor_samples",
            "Anchor passes (recent served completions kept close to the base model), by path.",
            labels=["path"],
        )
        anchors.add_metric(["replay"], s.anchor_replayed)
        anchors.add_metric(["recompute"], s.anchor_samples - s.anchor_replayed)
        yield anchors
        yield CounterMetricFamily(
            PREFIX + "training_anchor_tokens", "Anchor response tokens trained (once per epoch).", value=s.anchor_tokens
        )
        logps = CounterMetricFamily(
            PREFIX + "training_logp_passes",
            "Passes without gradient of the preference objectives, by kind (reference: the base model's "
            "log-probabilities; kl: KTO's reference point under the adapter) and path: replayed or recomputed.",
            labels=["kind", "path"],
        )
        for kind in ("reference", "kl"):
            logps.add_metric([kind, "replay"], getattr(s, f"{kind}_replayed"))
            logps.add_metric([kind, "recompute"], getattr(s, f"{kind}_recomputed"))
        yield logps
        layers = CounterMetricFamily(
            PREFIX + "training_record_layers",
            "Prompt layers of replayed records, by source: reloaded from the activation store or recomputed from "
            "their recorded input (the reload-or-recompute plan).",
            labels=["source"],
        )
        layers.add_metric(["reload"], s.layers_reloaded)
        layers.add_metric(["recompute"], s.layers_recomputed)
        yield layers
        yield CounterMetricFamily(
            PREFIX + "training_carried",
            "Corrections a mini-batch that yielded to those waiting behind it left queued, not learned yet, for the "
            "next one (each time).",
            value=s.carried,
        )
        yield CounterMetricFamily(
            PREFIX + "training_records_unreadable",
            "Replays abandoned because their record was corrupt or gone mid-read (recomputed instead).",
            value=s.unreadable,
        )
        gauges = (
            ("training_replay_hit_rate", "Share of sample passes replayed from a record.", s.replayed / max(passes, 1)),
            ("training_loss", "Loss of the last optimizer step (NaN before the first).", s.last_loss or float("nan")),
            ("training_tokens_per_second", "Training tokens/s of the last mini-batch.", s.last_tokens_per_s),
            (
                "training_anchor_kl",
                "Mean KL(base || adapted) of the last step's anchors (NaN before the first).",
                float("nan") if s.last_anchor_kl is None else s.last_anchor_kl,
            ),
            ("training_anchor_pool", "Served completions held as candidate anchors.", len(self.trainer.anchors)),
            ("adapter_version", "The LoRA adapter version being trained (0: none yet).", self.trainer.version),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        yield SummaryMetricFamily(
            PREFIX + "training_record_staleness",
            "Adapter versions between a replayed record and the adapter it trained.",
            count_value=s.replayed + s.anchor_replayed,
            sum_value=s.staleness_sum,
        )


class _AdapterCollector(Collector):
    """The named adapters' paging (``alchemist.runtime.adapter_registry``), read at scrape time."""

    def __init__(self, registry) -> None:  # an AdapterRegistry
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        r = self.registry
        for name, doc, value in (
            ("adapter_loads", "Named adapters paged into the engine (at first use, or again after an eviction).",
             r.num_loads),
            ("adapter_evictions", "Named adapters evicted from the engine to make room (least recently used).",
             r.num_evictions),
            ("adapter_disk_reads", "Named adapter directories read from disk.", r.num_disk_reads),
        ):  # fmt: skip
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + "adapters_registered", "Named adapters served (on disk or in the engine).",
                                value=len(r.paths()))  # fmt: skip
        yield GaugeMetricFamily(PREFIX + "adapters_in_engine", "Named adapters held in the engine (--max-loras).",
                                value=r.num_in_engine)  # fmt: skip


class LatencyWindow:
    """The TTFT and TPOT of recently finished requests, for the dashboard's percentiles (a histogram's buckets are
    too coarse for a p50 over a few seconds). Fed by ``ServerMetrics.observe``; read from another thread."""

    def __init__(self, maxlen: int = 4096):
        self._items: deque[tuple[float, float, float]] = deque(maxlen=maxlen)  # (finished at, ttft_s, tpot_s)
        self._lock = threading.Lock()

    def add(self, ttft_s: float, tpot_s: float, now: float | None = None) -> None:
        with self._lock:
            self._items.append((time.monotonic() if now is None else now, ttft_s, tpot_s))

    def since(self, t: float) -> tuple[list[float], list[float]]:
        """(TTFTs, TPOTs) of the requests that finished at or after monotonic time ``t``."""
        with self._lock:
            recent = [item for item in self._items if item[0] >= t]
        return [ttft for _, ttft, _ in recent], [tpot for _, _, tpot in recent]


class _FeedbackStateCollector(Collector):
    """The feedback log's backlog and states, read from the log when Prometheus scrapes (trainer or not)."""

    def __init__(self, log: FeedbackLog):
        self.log = log

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        count = GaugeMetricFamily(PREFIX + "feedback_backlog", "Feedback queued for training, by class.",
                                  labels=["kind"])  # fmt: skip
        age = GaugeMetricFamily(PREFIX + "feedback_backlog_oldest_seconds",
                                "Age of the oldest queued feedback of each class (0 when none).",
                                labels=["kind"])  # fmt: skip
        for kind, (n, oldest) in self.log.backlog().items():
            count.add_metric([kind], n)
            age.add_metric([kind], 0.0 if oldest is None else now - oldest)
        yield count
        yield age
        per_adapter = GaugeMetricFamily(PREFIX + "feedback_backlog_by_adapter", "Feedback queued for training, per "
                                        "adapter it trains (\"\": the shared one; named ones with some).",
                                        labels=["adapter"])  # fmt: skip
        for adapter, n in ({None: 0} | self.log.backlog_by_adapter()).items():
            per_adapter.add_metric([adapter or ""], n)
        yield per_adapter
        states = GaugeMetricFamily(PREFIX + "feedback_entries", "Feedback log entries by state.", labels=["state"])
        for state, n in self.log.counts("state").items():
            states.add_metric([state], n)
        yield states


class ServerMetrics:
    def __init__(self, read_stats: Callable[[], EngineStats], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS_S, registry=r
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", buckets=E2E_BUCKETS_S, registry=r
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from arrival to first schedule.",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.feedback = Counter(PREFIX + "feedback", "Feedback entries logged, by kind.", ["kind"], registry=r)
        self.step = Histogram(PREFIX + "engine_step_seconds", "Engine steps (requests in flight).",
                              buckets=STEP_BUCKETS_S, registry=r)  # fmt: skip
        self.slice = Histogram(
            PREFIX + "training_slice_seconds",
            "Training slices run between engine steps, by whether requests were in flight (serving=yes: a due step "
            "waited for the slice) or not (a request that arrives waits for one slice at most).",
            ["serving"],
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        for kind in KINDS:  # every kind from 0, so that rates exist before the first entry of a kind
            self.feedback.labels(kind=kind)
        r.register(_EngineStatsCollector(read_stats))
        self.read_stats = read_stats
        self.trainer = None  # the OnlineTrainer, once watch_training is called
        self.recent = LatencyWindow()

    def observe(self, outputs: Sequence[RequestOutput]) -> None:
        """Called with each step's outputs from the engine thread (prometheus_client is thread-safe)."""
        for out in outputs:
            if not out.finished:
                continue
            self.request_success.labels(finished_reason=out.finish_reason or "unknown").inc()
            t = out.timings
            if t is None:
                continue
            self.queue.observe(t.queue_s)
            self.e2e.observe(t.e2e_s)
            if out.output_token_ids:  # an aborted request may have none: no TTFT to speak of
                self.ttft.observe(t.ttft_s)
                self.tpot.observe(t.tpot_s)
                self.recent.add(t.ttft_s, t.tpot_s)

    def observe_step(self, seconds: float) -> None:
        """An engine step's time (the stepping thread)."""
        self.step.observe(seconds)

    def observe_slice(self, seconds: float, serving: bool) -> None:
        """A training slice's time, and whether requests were in flight (the stepping thread)."""
        self.slice.labels(serving="yes" if serving else "no").observe(seconds)

    def observe_feedback(self, entry: FeedbackEntry) -> None:
        """A FeedbackLog listener: called once per new entry (repeats of a submission are not new)."""
        self.feedback.labels(kind=entry.kind).inc()

    def watch_feedback(self, log: FeedbackLog) -> None:
        """Expose the feedback log's backlog (by class, with the oldest's age) and its entries by state."""
        self.registry.register(_FeedbackStateCollector(log))

    def show_objective(self, tpot_s: float, ttft_s: float) -> None:
        """Expose the latency objective serving keeps to (as set, or derived at start-up: alchemist.runtime)."""
        for name, doc, value in (
            ("slo_tpot_seconds", "The latency objective's time per output token (training yields to it).", tpot_s),
            ("slo_ttft_seconds", "The latency objective's time to first token.", ttft_s),
        ):
            Gauge(PREFIX + name, doc, registry=self.registry).set(value)

    def watch_training(self, trainer) -> None:
        """Expose the online trainer's metrics (an OnlineTrainer)."""
        self.trainer = trainer
        self.registry.register(_TrainingCollector(trainer))

    def watch_adapters(self, registry) -> None:
        """Expose the named adapters' page-ins, evictions and counts (an AdapterRegistry)."""
        self.registry.register(_AdapterCollector(registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
