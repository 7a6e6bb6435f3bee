"""A client that goes away aborts its request: the slot and KV blocks are freed, /metrics shows nothing running."""

from __future__ import annotations

import httpx
import pytest

from alchemist.bench import http_calls
from tests.server.conftest import MODEL_NAME

LONG = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 400,  # ~20 s of decoding: far longer than the test waits
    "ignore_eos": True,
}


def test_disconnect_during_streaming_aborts_the_request(server):
    aborted_before = server.metrics().get('alchemist:request_success_total{finished_reason="abort"}', 0.0)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.base_url + "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            data = [line for line, _ in zip(lines, range(10), strict=False) if line.startswith("data: ")]
            assert len(data) >= 3  # tokens are flowing
            assert server.metrics()["alchemist:num_requests_running"] == 1
    # Leaving the block closed the connection mid-stream.
    server.wait_for_metric("alchemist:num_requests_running", 0)
    server.wait_for_metric('alchemist:request_success_total{finished_reason="abort"}', aborted_before + 1)
    assert server.metrics()["alchemist:kv_cache_usage_perc"] == 0


def test_disconnect_during_a_non_streaming_request_aborts_it(server):
    with pytest.raises(httpx.ReadTimeout):
        http_calls.post(server.base_url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(30, read=1.5))
    server.wait_for_metric("alchemist:num_requests_running", 0)
    assert server.metrics()["alchemist:kv_cache_usage_perc"] == 0
