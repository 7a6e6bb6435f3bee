"""A served response's registry entry carries the adapter version its prefill used (what feedback trains on); with
training off, the version that training left serves."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from alchemist.config import Config, EngineConfig, OnlineConfig, ServerConfig
from alchemist.engine import LLMEngine
from alchemist.model.lora import LoraAdapter
from alchemist.runtime import build_around
from alchemist.server.app import create_app
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.slices import run_to_end


def test_registry_entry_carries_the_served_adapter_version(smollm2, tmp_path):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256))
    engine.set_adapter(LoraAdapter(smollm2.model.config, seed=0), 7)
    app = create_app(build_around(engine, Config(server=ServerConfig(data_dir=str(tmp_path))), ["m"]))
    with TestClient(app) as http:
        body = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        ).json()
    assert app.state.registry.get(body["id"]).adapter_version == 7


def test_without_training_the_last_checkpointed_version_serves(smollm2, tmp_path):
    """A server started with training off (--no-train) on a data dir that training left serves that version."""
    adapter = LoraAdapter(smollm2.model.config, seed=0)
    checkpoints = AdapterCheckpoints(tmp_path / "adapters", keep=4)
    for version in (2, 5):
        adapter.version = version
        run_to_end(checkpoints.save_slices(version, adapter, {"state": {}, "param_groups": []}, version * 10, {}))
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256))
    config = Config(online=OnlineConfig(enabled=False), server=ServerConfig(data_dir=str(tmp_path)))
    app = create_app(build_around(engine, config, ["m"]))
    assert engine.adapter_version == 5
    with TestClient(app) as http:
        listing = http.get("/v1/adapters").json()
        rollback = http.post("/v1/adapters/rollback", json={"version": 2})
    assert listing["serving_version"] == 5 and not listing["training"]
    assert [v["version"] for v in listing["data"]] == [5, 2] and listing["data"][0]["serving"]
    assert rollback.status_code == 400 and "--no-train" in rollback.json()["error"]["message"]


def test_responses_name_the_adapter_version_that_wrote_them(smollm2, tmp_path):
    """system_fingerprint is "alchemist-v<N>" in chat and text completions, streamed (every chunk) or not."""
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256))
    engine.set_adapter(LoraAdapter(smollm2.model.config, seed=0), 3)
    config = Config(online=OnlineConfig(enabled=False), server=ServerConfig(data_dir=str(tmp_path)))
    app = create_app(build_around(engine, config, ["m"]))
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    text = {"model": "m", "prompt": "Hi", "max_tokens": 3}
    with TestClient(app) as http:
        bodies = [http.post("/v1/chat/completions", json=chat).json(), http.post("/v1/completions", json=text).json()]
        streams = [
            http.post(path, json={**body, "stream": True}).text
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text))
        ]
    assert [b["system_fingerprint"] for b in bodies] == ["alchemist-v3", "alchemist-v3"]
    for stream in streams:
        chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
        assert len(chunks) >= 3 and all(c["system_fingerprint"] == "alchemist-v3" for c in chunks)
