"""When the step loop ends (server shutdown), the engine is closed: the activation store drops its records and
their files (a killed server's files are cleaned at the next start instead)."""

from __future__ import annotations

import asyncio

import torch

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.model.loader import build_model
from alchemist.runtime.async_engine import AsyncEngine
from tests.engine.helpers import char_tokenizer, random_prompts, run_to_end


def test_shutdown_removes_the_record_files(tiny_dirs, tmp_path):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    records = RecordConfig(
        policy="all", dtype="float32", store_budget_bytes=1_400_000, host_budget_bytes=0, disk_dir=str(tmp_path)
    )  # 4 records fill the device tier past 3/4: the oldest are written to disk
    engine = LLMEngine(model, char_tokenizer(), EngineConfig(max_num_seqs=4, max_model_len=128), records)
    for i, prompt in enumerate(random_prompts([60, 61, 62, 63], seed=1)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    run_to_end(engine)
    engine.store.flush()
    assert engine.store.stats.tier_bytes["disk"] > 0 and list(tmp_path.iterdir())

    async def serve_then_shut_down() -> None:
        async_engine = AsyncEngine(engine, own_step_thread=True)
        async_engine.start()
        await asyncio.sleep(0.05)
        async_engine.shutdown()

    asyncio.run(serve_then_shut_down())
    assert not list(tmp_path.iterdir())
    assert engine.store.stats.bytes_held == 0
