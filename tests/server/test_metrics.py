"""/metrics rendering from an EngineStats snapshot (no model needed)."""

from __future__ import annotations

from alchemist.engine import EngineStats
from alchemist.server.metrics import ServerMetrics


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
