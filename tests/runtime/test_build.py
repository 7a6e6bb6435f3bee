"""The runtime without HTTP: ``build_around`` a real engine on a tiny random model makes the system `alchemist serve`
runs (feedback log and adapters under the data dir, the latency objective, the online trainer, its time share, the
stepping loop), which serves a request and trains on a correction with no web framework in sight, its log in SQLite
or PostgreSQL (``--feedback-db postgresql://...``); with training off, no trainer and no time share. (``build`` with
the real model runs in every server test, through `alchemist serve`.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from alchemist.config import Config, EngineConfig, OnlineConfig, RecordConfig, ServerConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.postgres_log import PostgresFeedbackLog
from alchemist.model.loader import build_model
from alchemist.runtime import build_around
from tests.engine.helpers import char_tokenizer
from tests.training.test_online import tiny_loop_config


def tiny_engine(tiny_dirs) -> LLMEngine:
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    config = EngineConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
    return LLMEngine(model, char_tokenizer(), config, RecordConfig(dtype="float32"))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_built_system_serves_and_trains_without_http(tiny_dirs, tmp_path: Path, request, backend: str):
    engine = tiny_engine(tiny_dirs)
    # The loop as tests/training/test_online.py runs it on a tiny model: a correction trains at once, in one step.
    online = tiny_loop_config(queue={"batch_size": 1}, stopping={"epochs": 1})
    feedback_db = request.getfixturevalue("postgres_url") if backend == "postgresql" else None  # --feedback-db
    config = Config(online=online, server=ServerConfig(data_dir=str(tmp_path), feedback_db=feedback_db))
    system = build_around(engine, config, ["tiny"])
    assert system.store is engine.store and system.names == ["tiny"]
    assert system.trainer is not None and system.time_share is not None
    assert system.async_engine.time_share is system.time_share
    # the latency objective, derived from the tiny engine's probe steps: training yields to it, prefill is capped
    assert system.time_share.objective is system.objective and engine.tpot_objective_s == system.objective.tpot_s
    if backend == "sqlite":
        assert (tmp_path / "feedback.sqlite").exists()  # the log under the data dir, as `alchemist serve` keeps it
    else:
        assert isinstance(system.feedback_log, PostgresFeedbackLog)
    steps_s: list[float] = []
    system.observe(on_step_s=steps_s.append)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]

    async def serve_then_train() -> None:
        system.async_engine.start()  # its own stepping thread
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, record=True)
            outputs = [out async for out in system.async_engine.generate("r0", prompt, params)]
            system.feedback_log.append(
                response_id="r0", kind="sft", correction="x", prompt_token_ids=prompt,
                response_token_ids=[20, 21, 22], output_token_ids=list(outputs[-1].output_token_ids),
                adapter_version=outputs[-1].adapter_version, recorded=True,
            )  # fmt: skip
            deadline = time.monotonic() + 60
            # The log's listener woke the loop; the trainer publishes a version, then checkpoints it and tells the log.
            while engine.adapter_version == 0 or system.feedback_log.get(1).state != "trained":
                assert time.monotonic() < deadline, "no adapter version was served and its entry trained"
                await asyncio.sleep(0.05)
        finally:
            system.async_engine.shutdown()

    asyncio.run(serve_then_train())
    assert steps_s  # the observer saw the engine's steps
    assert engine.stats().num_recorded == 1  # the request asked, under RecordConfig's default policy
    assert (tmp_path / "adapters").is_dir()
    system.close()


def test_with_training_off_there_is_no_trainer(tiny_dirs, tmp_path: Path):
    config = Config(online=OnlineConfig(enabled=False), server=ServerConfig(data_dir=str(tmp_path)))
    system = build_around(tiny_engine(tiny_dirs), config, ["tiny"])
    assert system.trainer is None and system.time_share is None and system.async_engine.time_share is None
    system.close()
