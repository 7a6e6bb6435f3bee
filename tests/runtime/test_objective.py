"""The latency objective: kept as set, else derived from unloaded probe steps of the engine, which leave no trace but
the step cost they teach; the engine's prefill cap follows its TPOT."""

from __future__ import annotations

import pytest
import torch

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine
from alchemist.model.loader import build_model
from alchemist.runtime import objective as objective_module
from alchemist.runtime.objective import LatencyObjective, resolve_objective
from tests.engine.helpers import char_tokenizer


def tiny_engine(tiny_dirs, **fields) -> LLMEngine:
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    config = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, **fields)
    return LLMEngine(model, char_tokenizer(), config, RecordConfig(policy="all", dtype="float32"))


def test_derived_from_probe_steps_that_leave_no_trace(tiny_dirs):
    engine = tiny_engine(tiny_dirs)
    assert engine.tpot_objective_s is None  # no cap before the objective is known
    before = engine.stats()
    objective = resolve_objective(engine)
    assert 0 < objective.tpot_s < objective.ttft_s and engine.tpot_objective_s == objective.tpot_s
    assert engine.stats() == before  # nothing recorded (under policy "all"), counted or left waiting
    assert engine.block_manager.num_free_slots == 4 and engine.block_manager.usage == 0.0
    assert not engine.has_unfinished()
    assert engine.step_cost.decode_row_s is not None and engine.step_cost.prefill_token_s is not None


def test_the_derivation(tiny_dirs, monkeypatch):
    """TPOT 1.10 x the unloaded decode step; TTFT 1.10 x a chunk's prefill + the TPOT; a value set is kept. Under a
    derived TPOT training may add a tenth of any step; under one set by hand, only what it leaves."""
    monkeypatch.setattr(objective_module, "measure_unloaded", lambda engine: (0.020, 0.300))
    derived = LatencyObjective(pytest.approx(0.022), pytest.approx(0.352), pytest.approx(0.10))
    assert resolve_objective(tiny_engine(tiny_dirs)) == derived
    assert resolve_objective(tiny_engine(tiny_dirs, slo_tpot_s=0.05)) == LatencyObjective(0.05, pytest.approx(0.38))
    assert resolve_objective(tiny_engine(tiny_dirs, slo_ttft_s=1.0)) == LatencyObjective(
        pytest.approx(0.022), 1.0, pytest.approx(0.10))  # fmt: skip


def test_set_values_are_kept_and_nothing_is_probed(tiny_dirs):
    engine = tiny_engine(tiny_dirs, slo_tpot_s=0.05, slo_ttft_s=0.5)
    assert engine.tpot_objective_s == 0.05  # the engine alone caps by a TPOT set in its config
    assert resolve_objective(engine) == LatencyObjective(0.05, 0.5)
    assert engine.step_cost.decode_row_s is None and engine.step_cost.prefill_token_s is None  # no step ran
