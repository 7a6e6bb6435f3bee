"""/metrics rendering from an EngineStats snapshot (no model needed)."""

from __future__ import annotations

import types

from alchemist.engine import EngineStats
from alchemist.server.metrics import ServerMetrics
from alchemist.training.stats import TrainingStats


def _stats(**fields) -> EngineStats:
    """An idle engine's stats, but for ``fields``."""
    idle = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_prompt_tokens=0, num_generation_tokens=0)
    return EngineStats(**{**idle, "num_preemptions": 0, "num_finished": 0, **fields})


def test_activation_store_bytes_per_tier():
    stats = _stats(
        activation_bytes=700, activation_records=3, activation_tier_bytes={"device": 100, "host": 200, "disk": 400}
    )
    text = ServerMetrics(lambda: stats).render().decode()
    assert "alchemist:activation_store_bytes 700.0" in text
    for tier, value in (("device", 100), ("host", 200), ("disk", 400)):
        assert f'alchemist:activation_store_tier_bytes{{tier="{tier}"}} {value}.0' in text


def test_prefix_cache_counters():
    stats = _stats(num_prefix_cache_queries=300, num_prefix_cache_hits=192)
    text = ServerMetrics(lambda: stats).render().decode()
    assert "# TYPE alchemist:prefix_cache_queries_total counter" in text
    assert "alchemist:prefix_cache_queries_total 300.0" in text
    assert "alchemist:prefix_cache_hits_total 192.0" in text


def test_preference_passes_without_gradient_by_kind_and_path():
    metrics = ServerMetrics(lambda: _stats())
    # what the collector reads of an OnlineTrainer: its counters (a TrainingStats snapshot), anchors and version
    stats = TrainingStats(reference_replayed=8, reference_recomputed=2, kl_replayed=5, kl_recomputed=1, carried=4)
    metrics.watch_training(types.SimpleNamespace(stats=stats, anchors=[], version=3))
    text = metrics.render().decode()
    assert "alchemist:training_carried_total 4.0" in text  # corrections a yielding batch left for the next
    for kind, path, value in (("reference", "replay", 8), ("reference", "recompute", 2), ("kl", "replay", 5),
                              ("kl", "recompute", 1)):  # fmt: skip
        assert f'alchemist:training_logp_passes_total{{kind="{kind}",path="{path}"}} {value}.0' in text


def test_engine_steps_and_training_slices_histograms():
    metrics = ServerMetrics(lambda: _stats())
    for seconds in (0.004, 0.02, 0.25):
        metrics.observe_step(seconds)
    metrics.observe_slice(0.04, serving=True)
    metrics.observe_slice(0.3, serving=True)
    metrics.observe_slice(0.06, serving=False)
    text = metrics.render().decode()
    assert "alchemist:engine_step_seconds_count 3.0" in text
    assert 'alchemist:engine_step_seconds_bucket{le="0.1"} 2.0' in text
    assert 'alchemist:training_slice_seconds_count{serving="yes"} 2.0' in text
    assert 'alchemist:training_slice_seconds_bucket{le="0.1",serving="yes"} 1.0' in text
    assert 'alchemist:training_slice_seconds_count{serving="no"} 1.0' in text


def test_the_latency_objective_is_shown():
    metrics = ServerMetrics(lambda: _stats())
    metrics.show_objective(tpot_s=0.033, ttft_s=0.5)
    text = metrics.render().decode()
    assert "alchemist:slo_tpot_seconds 0.033" in text and "alchemist:slo_ttft_seconds 0.5" in text
