"""A served response's registry entry carries the adapter version its prefill used (what feedback trains on)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from alchemist.config import EngineConfig, ServerConfig
from alchemist.engine import LLMEngine
from alchemist.model.lora import LoraAdapter
from alchemist.server.app import app_for_engine


def test_registry_entry_carries_the_served_adapter_version(smollm2, tmp_path):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256))
    engine.set_adapter(LoraAdapter(smollm2.model.config, seed=0), 7)
    app = app_for_engine(engine, ["m"], ServerConfig(data_dir=str(tmp_path)))
    with TestClient(app) as http:
        body = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        ).json()
    assert app.state.registry.get(body["id"]).adapter_version == 7
