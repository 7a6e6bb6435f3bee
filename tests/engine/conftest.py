"""Engine test fixtures: the tiny random model, and a factory of engines over it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine
from alchemist.model.llama import Llama
from alchemist.model.loader import build_model
from tests.engine.helpers import DEFAULT_EOS_ID, char_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tiny_dirs) -> Llama:
    return build_model(tiny_dirs["llama-gqa-untied"], torch.float32)


@pytest.fixture
def make_engine(tiny_model) -> Callable[..., LLMEngine]:
    """``make_engine(eos_id=5, **EngineConfig fields)``: a fresh engine (its own cache) over the tiny model, with 16
    slots unless told (small step budgets need max_num_seqs <= max_num_batched_tokens)."""

    def make(eos_id: int = DEFAULT_EOS_ID, **fields) -> LLMEngine:
        fields.setdefault("max_num_seqs", 16)
        return LLMEngine(tiny_model, char_tokenizer(eos_id), EngineConfig(**fields))

    return make


TOPICS = [
    "the history of Rome",
    "how photosynthesis works",
    "a recipe for bread",
    "quantum computing",
    "the French revolution",
    "how to learn piano",
    "black holes",
    "machine learning",
]


@pytest.fixture(scope="session")
def chat_prompts(smollm2) -> list[list[int]]:
    """Eight chat prompts of 38 to 372 tokens on the real model (its exactness tests)."""
    tok = smollm2.tokenizer
    padding = "Please be detailed."
    return [
        tok.apply_chat_template([{"role": "user", "content": f"{' '.join([padding] * (12 * i))} Tell me about {t}."}])
        for i, t in enumerate(TOPICS)
    ]
