"""The dashboard's time series: ring buffers of what /metrics reads, sampled once a second, and their endpoint on a
real server process."""

from __future__ import annotations

import time

from alchemist.bench import http_calls
from alchemist.engine import EngineStats
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.server.metrics import ServerMetrics
from alchemist.server.series import SERIES, SeriesRecorder, percentile
from tests.server.conftest import MODEL_NAME


def engine_stats(generated: int, running: int = 0) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=1, kv_cache_usage=0.25, num_prompt_tokens=0,
        num_generation_tokens=generated, num_preemptions=0, num_finished=0,
        activation_tier_bytes={"device": 100, "host": 20, "disk": 3},
    )  # fmt: skip


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)


def test_samples_make_rates_percentiles_and_a_bounded_ring(tmp_path):
    stats = [engine_stats(0)]
    metrics = ServerMetrics(lambda: stats[0])
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    recorder = SeriesRecorder(metrics, log, lambda: 4, capacity=3)
    recorder.sample()
    for ttft in (0.1, 0.2, 0.3):
        metrics.recent.add(ttft, ttft / 10)
    stats[0] = engine_stats(50, running=2)
    time.sleep(0.05)
    recorder.sample()
    got = recorder.snapshot()
    assert set(got["series"]) == set(SERIES) and len(got["t"]) == 2
    s = {name: values[-1] for name, values in got["series"].items()}
    assert got["series"]["generation_tokens_per_s"][0] is None  # no rate before a second sample
    assert 50 < s["generation_tokens_per_s"] < 50 / 0.05 + 1
    assert (s["ttft_p50_s"], s["ttft_p99_s"], s["tpot_p99_s"]) == (0.2, 0.3, 0.03)
    assert (s["requests_running"], s["requests_waiting"], s["adapter_version"], s["feedback_backlog"]) == (2, 1, 4, 0)
    assert (s["activation_bytes_device"], s["activation_bytes_host"], s["activation_bytes_disk"]) == (100, 20, 3)
    assert s["training_loss"] is None and s["replay_hit_rate"] is None  # no trainer watched
    for _ in range(3):
        recorder.sample()
    got = recorder.snapshot()
    assert len(got["t"]) == 3 and all(len(v) == 3 for v in got["series"].values())  # the oldest fell out
    assert recorder.snapshot(since=got["t"][1])["t"] == got["t"][2:]
    log.close()


def test_series_endpoint_of_a_real_server(server, client):
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    deadline = time.monotonic() + 10
    while True:  # the next sample (a second at most) sees the finished request within its window
        got = http_calls.get(server.base_url + "/v1/dashboard/series", timeout=10).json()
        if got["t"] and got["series"]["ttft_p50_s"][-1] is not None:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    assert got["object"] == "dashboard.series" and got["interval_s"] == 1.0
    assert set(got["series"]) == set(SERIES) and all(len(v) == len(got["t"]) for v in got["series"].values())
    assert got["series"]["ttft_p50_s"][-1] > 0 and got["series"]["adapter_version"][-1] == 0
    assert got["series"]["training_loss"][-1] is None  # --no-train
    later = http_calls.get(server.base_url + "/v1/dashboard/series", params={"since": got["t"][-1]}, timeout=10).json()
    assert all(t > got["t"][-1] for t in later["t"])
    bad = http_calls.get(server.base_url + "/v1/dashboard/series", params={"since": "yesterday"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.since"
