"""The registry that keeps finished completions by response id, for feedback to find."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from alchemist.config import Config, EngineConfig, ServerConfig
from alchemist.engine import LLMEngine
from alchemist.runtime import build_around
from alchemist.server.app import create_app
from alchemist.server.completions_registry import CompletionRecord, CompletionsRegistry


def record(i: int, created_s: float | None = None) -> CompletionRecord:
    return CompletionRecord(
        id=f"cmpl-{i}",
        prompt_token_ids=[1, 2],
        output_token_ids=[3],
        text="x",
        model="m",
        adapter_version=0,
        finish_reason="stop",
        **({"created_s": created_s} if created_s is not None else {}),
    )


def test_least_recently_used_goes_first():
    registry = CompletionsRegistry(max_entries=2)
    registry.add(record(1))
    registry.add(record(2))
    assert registry.get("cmpl-1") is not None  # now 2 is the least recently used
    registry.add(record(3))
    assert registry.get("cmpl-2") is None
    assert registry.get("cmpl-1").id == "cmpl-1" and registry.get("cmpl-3").id == "cmpl-3"
    assert len(registry) == 2


def test_old_records_expire():
    registry = CompletionsRegistry(ttl_s=60)
    registry.add(record(1, created_s=time.time() - 120))
    registry.add(record(2))
    assert registry.get("cmpl-1") is None
    assert registry.get("cmpl-2") is not None
    assert len(registry) == 1


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_entries"):
        CompletionsRegistry(max_entries=0)
    with pytest.raises(ValueError, match="ttl_s"):
        CompletionsRegistry(ttl_s=0)


def test_a_served_response_is_reachable_by_its_id(smollm2, tmp_path):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256))
    app = create_app(build_around(engine, Config(server=ServerConfig(data_dir=str(tmp_path))), ["m"]))
    messages = [{"role": "user", "content": "Hi"}]
    with TestClient(app) as http:
        body = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0, "alchemist": {"record": True}},
        ).json()
        streamed = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3, "stream": True})
    entry = app.state.registry.get(body["id"])
    assert entry.prompt_token_ids == smollm2.tokenizer.apply_chat_template(messages)
    assert len(entry.output_token_ids) == body["usage"]["completion_tokens"]
    assert entry.text == body["choices"][0]["message"]["content"]
    assert (entry.model, entry.adapter_version, entry.recorded) == ("m", 0, True)
    stream_id = streamed.text.split('"id":"')[1].split('"')[0]
    assert stream_id.startswith("cmpl-")
    assert len(app.state.registry.get(stream_id).output_token_ids) == 3
