"""Fixtures of the training tests."""

from __future__ import annotations

import pytest
import torch

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine
from alchemist.model.loader import build_model
from tests.engine.helpers import char_tokenizer
from tests.training.test_replay import lora_with_nonzero_b


@pytest.fixture
def engine(tiny_dirs) -> LLMEngine:
    """A real engine on a tiny random model that records every prompt (fp32 records) into its store."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    config = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
    return LLMEngine(model, char_tokenizer(), config, RecordConfig(policy="all", dtype="float32"))


@pytest.fixture(scope="module")
def model(tiny_dirs):
    """A tiny random model (GQA, untied embeddings) in fp32, for replay tests."""
    return build_model(tiny_dirs["llama-gqa-untied"], torch.float32)


@pytest.fixture(scope="module")
def adapter(model):
    """A LoRA adapter on ``model`` whose B is not zero (it changes the outputs)."""
    return lora_with_nonzero_b(model)
